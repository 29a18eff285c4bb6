"""The demo: synthetic two-view identities (tools/make_synthetic.py), a tiny network, CPU-sized.

    python tools/make_synthetic.py --out data/synthetic_pair     # make demo does this when missing
    python train.py configs/synthetic_pair.py
"""
rec = "data/synthetic_pair"        # train.rec/train.idx of 112x224 two-view records + synthetic_val.bin
num_views = 2
view_source = "record"
network = "r18"
network_kwargs = {"width_mult": 0.25}
embedding_size = 128
margin_list = (1.0, 0.5, 0.0)
optimizer = "sgd"
lr = 0.1
weight_decay = 5e-4
batch_size = 64
num_epoch = 4
warmup_epoch = 0
num_workers = 1
frequent = 10
verbose = 100
val_targets = ("synthetic_val",)
output = "output/synthetic_pair"
