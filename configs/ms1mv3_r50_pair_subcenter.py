"""configs/ms1mv3_r50_pair.py with sub-center ArcFace: 3 centres per class (the paper's K), ArcFace's 0.5.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair_subcenter.py

The classifier holds K = 3 rows per class (3x the centres' memory: see --dry-run); a class's cosine is
its nearest sub-centre's, so noisy images of a class can gather around a sub-centre of their own. The
paper trains it on noisy web data (MS1MV0); on a cleaned set such as MS1MV3 expect ArcFace's accuracy.
"""
rec = "/train_tmp/ms1mv3_pair"
num_views = 2
view_source = "record"
num_classes = 93431
network = "r50"
margin_family = "subcenter"
subcenter_k = 3
margin_list = (1.0, 0.5, 0.0)      # ArcFace over the sub-centres
fp16 = True
lr = 0.1
batch_size = 128
num_epoch = 20
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/ms1mv3_r50_pair_subcenter"
