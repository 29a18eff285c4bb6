"""Your own photos, trained on a CPU: the README's "Your own photos" walk-through.

    python -m tools.pack_rec photos/ data/my_faces --views 2 --detect
    python -m tools.make_bin photos_val/ data/my_faces/my_faces_val.bin --random 50 --detect
    python train.py configs/my_faces.py

Sized for a few dozen people with a handful of photos each on 2 CPU cores (minutes): a tiny network and
the demo's recipe (CosFace at s=32 under AdamW learns from few classes where ArcFace at s=64 under SGD
stalls). Pairs of one person's photos side by side (--views 2) give each step two views of everyone.
"""
rec = "data/my_faces"              # tools.pack_rec's output: train.rec/train.idx, and my_faces_val.bin beside them
num_views = 2
view_source = "record"
network = "r18"
network_kwargs = {"width_mult": 0.0625}  # 1/16 of r18's channel widths: fast on a CPU
embedding_size = 128
margin_list = (1.0, 0.0, 0.35)     # CosFace
margin_scale = 32.0
optimizer = "adamw"
lr = 0.002
weight_decay = 0.05
batch_size = 16                    # records: 32 photos per step
num_epoch = 20
num_workers = 1
frequent = 10
verbose = 30
val_targets = ("my_faces_val",)    # tools.make_bin's set of people kept out of training
