"""Real faces on a CPU: LFW's DevTrain people, two views of each person per sample, verified on pairsDevTest.

    python -m experiments.real_faces /path/to/lfw  # prepares the data, trains this and the other rows, prints the table
    python train.py configs/lfw_r18_pair.py --set rec=data/lfw_bench/lfw_devtrain   # this recipe alone, once prepared

LFW's DevTrain view: 4,038 people, 9,525 photos, most people with one photo; the held-out set is pairsDevTest
(500 same-person and 500 different-person pairs of 1,711 other people), written by experiments.real_faces as
lfw_devtest.bin beside the records. One photo per record (tools.pack_rec --views 1); view_source="identity"
makes the second view another photo of the same person (the same photo, flipped independently, for people with
one photo). Budget and figure (docs/real_faces.md, 2026-12-05): 148 steps of 128 images, about 7 CPU minutes a run,
held-out Accuracy-Flip 0.758 (mean of 3 seeds; one view 0.766, can't tell apart); the suite runs the same bench at
tiny shapes (tests/test_real_faces.py). The best recipe measured is configs/lfw_r18_recipe.py (one view, s = 32,
0.798); this file at s = 32 and its length (2026-12-06) reads 0.791, can't be told from it (-0.7 points).
"""
rec = "data/lfw_bench/lfw_devtrain"  # experiments.real_faces' work folder: train.rec/train.idx and lfw_devtest.bin
num_views = 2
view_source = "identity"
network = "r18"
network_kwargs = {"width_mult": 0.125}  # 1/8 of r18's channel widths: ~100 images/s of training on 2 cores
embedding_size = 128
margin_list = (1.0, 0.5, 0.0)      # ArcFace, at arcface_torch's s = 64
margin_scale = 64.0
optimizer = "sgd"                  # arcface_torch's one-GPU values (its ms1mv3_r50_onegpu: lr 0.02 at batch 128)
lr = 0.02
momentum = 0.9
weight_decay = 5e-4
batch_size = 64                    # records: 128 photos per step
num_epoch = 2                      # 296 steps (~38,000 photos), the length experiments.real_faces measured
num_workers = 0                    # decoding 128 small JPEGs is ~3% of a step here: a worker process would take one
                                   # of 2 cores from the backbone's threads (measured 54 vs 99 images/s)
frequent = 50
verbose = 150
val_targets = ("lfw_devtest",)
keep_best = "lfw_devtest"          # output/<run>/best/: the backbone of the best lfw_devtest verification
