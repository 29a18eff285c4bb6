"""Glint360K packed as two-view records, r100, 8 GPUs, Partial FC sampling 10% of the centres.

    torchrun --nproc_per_node=8 train.py configs/glint360k_r100_pair.py

With the plain Glint360K .rec instead of a two-view one, set view_source = "identity".
"""
rec = "/train_tmp/glint360k_pair"  # train.rec/train.idx of 112x224 records, plus the val .bin files
num_views = 2
view_source = "record"
num_classes = 360232
network = "r100"
margin_list = (1.0, 0.0, 0.4)      # CosFace, as arcface_torch's glint360k recipes
sample_rate = 0.1                  # each step: the batch's classes + random negatives, 10% of each shard
fp16 = True
lr = 0.1
weight_decay = 1e-4
batch_size = 128
num_epoch = 20
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/glint360k_r100_pair"
