"""configs/ms1mv3_r50_pair.py with CurricularFace (m=0.5, s=64, t's EMA rate 0.01, the paper's).

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair_curricular.py

Hard negatives are weighted up by t, the EMA of the global batch's mean target cosine over both views.
"""
rec = "/train_tmp/ms1mv3_pair"
num_views = 2
view_source = "record"
num_classes = 93431
network = "r50"
margin_family = "curricular"
curricular_m = 0.5
curricular_alpha = 0.01
fp16 = True
lr = 0.1
batch_size = 128
num_epoch = 20
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/ms1mv3_r50_pair_curricular"
