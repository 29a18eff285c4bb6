"""MS1MV3 (ms1m-retinaface-t1), one view per sample, r50, 8 GPUs: arcface_torch's ms1mv3_r50 recipe.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50.py
"""
rec = "/train_tmp/ms1m-retinaface-t1"   # train.rec/train.idx of 112x112 images, plus the val .bin files
num_views = 1
num_classes = 93431
network = "r50"
margin_list = (1.0, 0.5, 0.0)
fp16 = True
lr = 0.1
weight_decay = 5e-4
batch_size = 128
num_epoch = 20
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/ms1mv3_r50"
