"""MS1MV3 packed as two-view records (each 112x224 record = two photos of one identity), r50, 8 GPUs.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair.py

Keys not set here keep configs/base.py's defaults (SGD with momentum 0.9, no warmup, embedding
512, a log line every 10 steps, verification every 2000 steps).
"""
rec = "/train_tmp/ms1mv3_pair"   # train.rec/train.idx of 112x224 records, plus lfw.bin, cfp_fp.bin, agedb_30.bin
num_views = 2
view_source = "record"
num_classes = 93431
network = "r50"
margin_list = (1.0, 0.5, 0.0)      # ArcFace
fp16 = True
lr = 0.1                           # for the global batch of 8 x 128 records (2048 images), as upstream
weight_decay = 5e-4
batch_size = 128                   # records per GPU: 256 images per GPU per step
num_epoch = 20
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/ms1mv3_r50_pair"
