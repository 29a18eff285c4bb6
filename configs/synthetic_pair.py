"""The demo: synthetic two-view identities (tools/make_synthetic.py), a tiny network, CPU-sized.

    python tools/make_synthetic.py --output data/synthetic_pair    # make demo does this when missing
    python train.py configs/synthetic_pair.py

Tuned to verify held-out synthetic identities at >= 0.95 in a few minutes on 2 CPU cores. The loss
and optimizer differ from the GPU recipes on purpose: with a few hundred classes and a network this
small, ArcFace's 0.5 margin at s=64 under SGD stalls on a plateau for hundreds of steps, where
CosFace at s=32 under AdamW learns at once.
"""
rec = "data/synthetic_pair"        # train.rec/train.idx of 112x224 two-view records + synthetic_val.bin
num_views = 2
view_source = "record"
network = "r18"
network_kwargs = {"width_mult": 0.0625}  # 1/16 of r18's channel widths: 0.25M parameters
embedding_size = 128
margin_list = (1.0, 0.0, 0.35)     # CosFace
margin_scale = 32.0                # s: a few hundred classes need far less than the 64 of 10^5 classes
optimizer = "adamw"
lr = 0.002
weight_decay = 0.05
batch_size = 16                    # records: 32 images per step
num_epoch = 6
num_workers = 1
frequent = 25
verbose = 150
val_targets = ("synthetic_val",)
output = "output/synthetic_pair"
