"""Every configuration key, with its default and what it does.

An experiment file (e.g. configs/ms1mv3_r50_pair.py) assigns module-level names that override
these; `train.py configs/X.py --set key=value` overrides both. Only keys defined here exist: a
misspelt key is an error that suggests the closest one. The annotation of each key is its type;
`--set` values are parsed as Python literals and checked against it (a `Literal[...]` lists the
values a key accepts).
"""
from typing import Literal

# --- data ---------------------------------------------------------------------------------
rec: str = ""                     # folder with train.rec/train.idx (+ val .bin files), an image folder, or "synthetic"
num_views: int = 1                # images per record fed through the backbone (2: a 112x224 record = two 112x112 views)
view_source: Literal["record", "identity", "augment"] = "record"  # where the views come from: "record" (side by
                                  # side in one record), "identity" (other photos of the record's identity),
                                  # "augment" (copies of one image)
num_classes: int | None = None    # identities in the classifier; None: read from the data
flip: bool = True                 # random horizontal flip, drawn independently per view
skip_bad_records: bool = False    # skip undecodable records (counted and logged) instead of stopping
num_workers: int = 2              # data-loading processes per training process
seed: int = 2048                  # seeds data order, augmentation, initialisation and centre sampling

# --- model --------------------------------------------------------------------------------
network: str = "r50"              # backbone: r18 r34 r50 r100 r200 r2060 mbf mbf_large vit_t vit_s vit_b, and
                                  # vit_t_dp005_mask0 vit_s_dp005_mask_0 vit_b_dp005_mask_005 vit_l_dp005_mask_005 vit_h
network_kwargs: dict = {}         # extra backbone options, e.g. {"width_mult": 0.25} for CPU-sized runs
embedding_size: int = 512         # length of the face embedding
dropout: float = 0.0              # dropout before the embedding layer

# --- loss ---------------------------------------------------------------------------------
margin_list: tuple[float, ...] = (1.0, 0.5, 0.0)  # (m1, m2, m3): target logit s*(cos(m1*theta + m2) - m3);
                                                  # ArcFace (1, 0.5, 0), CosFace (1, 0, 0.4)
margin_scale: float = 64.0        # s, the logit scale
sample_rate: float = 1.0          # Partial FC: fraction of class centres used per step (positives always kept)
view_weights: tuple[float, ...] | None = None  # loss weight per view; None: equal, summing to 1 (lr carries over)
interclass_filtering_threshold: float = 0.0    # drop negatives with cosine above this (0: off)
straight_through_margin: bool = False          # gradient of the margin taken as if no margin was applied

# --- precision ----------------------------------------------------------------------------
fp16: bool = False                # backbone in float16 autocast with a GradScaler (margin softmax stays float32)
bf16: bool = False                # backbone in bfloat16 autocast, no scaler needed (exclusive with fp16)

# --- optimisation -------------------------------------------------------------------------
optimizer: Literal["sgd", "adamw"] = "sgd"  # one optimizer, backbone and class centres as two param groups
lr: float = 0.1                   # learning rate of the GLOBAL batch batch_size * world_size * gradient_acc, as is:
                                  # like arcface_torch, nothing is rescaled when the number of processes changes
momentum: float = 0.9             # SGD momentum (ignored by adamw)
weight_decay: float = 5e-4        # the same for backbone and centres, as upstream
batch_size: int = 128             # records per process per forward (a record holds num_views images)
gradient_acc: int = 1             # forwards accumulated per optimizer step (loss divided, no DDP sync in between)
max_grad_norm: float = 5.0        # backbone gradient clipped to this L2 norm before each step
num_epoch: int = 20               # passes over the data
warmup_epoch: int = 0             # linear warmup from 0 to lr, then polynomial (power 2) decay to 0 at the end
max_steps: int = 0                # stop after this many optimizer steps (0: run num_epoch); the LR schedule still
                                  # spans num_epoch
max_nonfinite_steps: int = 10     # this many non-finite losses in a row stop the run (each one skips its step)

# --- logging and evaluation ---------------------------------------------------------------
frequent: int = 10                # a log line (speed, loss per view, lr, ETA) every this many steps
verbose: int = 2000               # verification on val_targets every this many steps (and at the end)
val_targets: tuple[str, ...] = () # .bin verification sets: names looked up as <rec>/<name>.bin, or paths

# --- output and resume --------------------------------------------------------------------
output: str = ""                  # run folder (log, TensorBoard, checkpoint.pt, backbone.pth); "": output/<config name>
save_all_states: bool = True      # write the full resumable checkpoint.pt (False: only backbone.pth)
save_every_steps: int = 0         # also checkpoint every this many steps (0: at the end of each epoch only)
resume: bool | str = False        # True: continue the run in `output`; a path: start from that checkpoint.pt,
                                  # run folder or bare backbone.pth (e.g. from arcface_torch) into a new output
