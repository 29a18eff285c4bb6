"""Semi-Siamese Training on real shallow data on a CPU: LFW's DevTrain people, most with one photo, classified
against a queue of a momentum network's features instead of learned class centres (docs/training.md).

    python -m experiments.real_faces /path/to/lfw --rows one_view two_view sst   # against the centre rows, paired
    python train.py configs/lfw_r18_sst.py --set rec=data/lfw_bench/lfw_devtrain   # this recipe alone, once prepared

configs/lfw_r18_pair.py with the classifier swapped and nothing else: the same data (two views of each person per
record: another photo of them, or the same photo flipped for people with one), network, optimizer, margin and
length, so that a difference in verification on pairsDevTest is the classifier's. The queue and the momentum are
sized for a run of ~300 steps: FaceX-Zoo's 16384 slots would take 256 steps of 64 records to fill once, and its
momentum 0.999 would leave the gallery three quarters the random start after 300 steps.
"""
rec = "data/lfw_bench/lfw_devtrain"  # experiments.real_faces' work folder: train.rec/train.idx and lfw_devtest.bin
num_views = 2
view_source = "identity"
network = "r18"
network_kwargs = {"width_mult": 0.125}
embedding_size = 128
margin_list = (1.0, 0.5, 0.0)      # ArcFace at s = 64, as the centre rows
margin_scale = 64.0
optimizer = "sgd"
lr = 0.02
momentum = 0.9
weight_decay = 5e-4
batch_size = 64                    # records: 128 photos per step
num_epoch = 2
num_workers = 0
frequent = 50
verbose = 150
val_targets = ("lfw_devtest",)
keep_best = "lfw_devtest"
sst = True
sst_queue_size = 4096              # 64 steps of one view's 64 gallery features
sst_momentum = 0.99                # the gallery follows the trained network with a half-life of ~70 steps
sst_enqueue = "one"                # FaceX-Zoo's: one view's features a step, drawn at random
