"""configs/ms1mv3_r50_pair.py with sub-center ArcFace: 3 centres per class (the paper's K), ArcFace's 0.5.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair_subcenter.py

The classifier holds K = 3 rows per class (3x the centres' memory: see --dry-run); a class's cosine is
its nearest sub-centre's, so noisy images of a class can gather around a sub-centre of their own. The
paper trains it on noisy web data (MS1MV0); on a cleaned set such as MS1MV3 expect ArcFace's accuracy.

Cleaning and retraining, as the paper does (docs/training.md, "Noisy labels"): drop every record farther than
75 degrees from its class's dominant sub-centre, then train plain ArcFace on what is left:

    torchrun --nproc_per_node=8 -m tools.clean_rec output/ms1mv3_r50_pair_subcenter /data/noisy /data/noisy_drop75
    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair.py --set rec=/data/noisy_drop75 \
        --set num_classes=N --set num_image=M        # the counts tools.clean_rec prints
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
