"""Every configuration key, with its default and what it does.

An experiment file (e.g. configs/ms1mv3_r50_pair.py) assigns module-level names that override
these, or is an arcface_torch config file (`config = edict()`, `config.key = value`), run unchanged;
`train.py configs/X.py --set key=value` overrides both. Only keys defined here exist (and those a margin
family added later declares in its own file, margin_families.py): a misspelt key is an error that suggests
the closest one. The annotation of each key is its type; `--set` values are parsed as Python literals and
checked against it (a `Literal[...]` lists the values a key accepts).
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
num_image: int | None = None      # samples in the data, as arcface_torch's configs state it: checked against the
                                  # data (a mismatch is an error); for rec="synthetic" the length of an epoch
dali: bool = False                # decode JPEG on the GPU (nvJPEG, batched) instead of in the data workers
dali_aug: bool = False            # arcface_torch's DALI augmentations, drawn per view: low resolution, blur,
                                  # hue/saturation, grey
crop_scale: tuple[float, float] = (1.0, 1.0)  # random resized crop per view (small data: scale and shift
                                  # jitter): a square of area fraction uniform in (low, high), e.g. (0.7, 1.0), at a
                                  # uniform position in the view, resized back to 112x112 (bilinear, antialiased);
                                  # (1.0, 1.0): off. Applied after the flip, before dali_aug
erase_p: float = 0.0              # random erasing per view (Zhong et al.; torchvision's RandomErasing): with this
                                  # probability a rectangle of area fraction in [0.02, 0.33] and aspect ratio in
                                  # [0.3, 3.3] is set to black (0); applied last, e.g. 0.5 on small data; 0: off

# --- model --------------------------------------------------------------------------------
network: str = "r50"              # backbone: a name of backbones/registry.py's (arcface_torch's: r18 ... r2060, mbf,
                                  # vit_t ... vit_h); a misspelt one is an error listing them all
network_kwargs: dict = {}         # extra backbone options, e.g. {"width_mult": 0.25} for CPU-sized runs
embedding_size: int = 512         # length of the face embedding
dropout: float = 0.0              # dropout before the embedding layer

# --- loss ---------------------------------------------------------------------------------
margin_family: str = "combined"   # the margin softmax, a family of margin_families.py: "combined" (margin_list,
                                  # arcface_torch's), "subcenter" (margin_list over subcenter_k centres per class),
                                  # "adaface", "curricular", "elastic_arc", "elastic_cos" with their keys below (a
                                  # family added later declares its own); every family scales by margin_scale
                                  # (README: the papers' settings)
margin_list: tuple[float, ...] = (1.0, 0.5, 0.0)  # (m1, m2, m3): target logit s*(cos(m1*theta + m2) - m3);
                                                  # ArcFace (1, 0.5, 0), CosFace (1, 0, 0.4)
margin_scale: float = 64.0        # s, the logit scale
subcenter_k: int = 3              # sub-center ArcFace: centres per class, a class's cosine the largest of its K
adaface_m: float = 0.4            # AdaFace: margin, scaled per sample by its feature norm's place in the batch
adaface_h: float = 0.333          # AdaFace: how far the norm moves the margin (z = clip(h * standardised norm))
adaface_t_alpha: float = 0.01     # AdaFace: EMA rate of the global batch's norm mean and std
curricular_m: float = 0.5         # CurricularFace: angular margin of the target
curricular_alpha: float = 0.01    # CurricularFace: EMA rate of t, the global batch's mean target cosine
elastic_m: float | None = None    # ElasticFace: mean margin; None: the paper's, 0.5 (elastic_arc) or 0.35 (elastic_cos)
elastic_std: float | None = None  # ElasticFace: margin std; None: the paper's, 0.05 (with elastic_plus 0.0175 for
                                  # arc, 0.02 for cos)
elastic_plus: bool = False        # ElasticFace+: the step's margins handed out by target cosine (largest: smallest)
sample_rate: float = 1.0          # Partial FC: fraction of class centres used per step (positives always kept);
                                  # 0: only the classes of the step's batch (arcface_torch's PartialFC_V2)
view_weights: tuple[float, ...] | None = None  # loss weight per view; None: equal, summing to 1 (lr carries over)
interclass_filtering_threshold: float = 0.0    # drop negatives with cosine above this (0: off)
straight_through_margin: bool = False          # gradient of the margin taken as if no margin was applied

# --- semi-siamese training (shallow data: few photos per identity; docs/training.md) ----------
sst: bool = False                 # Semi-Siamese Training: each view's features (probe) classified against a queue of
                                  # the other view's features from a momentum copy of the backbone (gallery, shuffled
                                  # BatchNorm) instead of learned class centres; needs num_views=2
sst_queue_size: int = 16384       # prototype queue slots over all processes (FaceX-Zoo's 16384), sharded like the
                                  # centres; at least the gallery features a step enqueues (global batch, x2 for "both")
sst_momentum: float = 0.999       # gallery <- m * gallery + (1 - m) * backbone after every step (FaceX-Zoo's alpha)
sst_enqueue: Literal["one", "both"] = "one"  # gallery features a step enqueues: one view's, drawn per step
                                  # (FaceX-Zoo's), or both views' (the queue turns over twice as fast)
sst_centre_weight: float = 0.0    # w in [0, 1): loss = (1 - w) * queue loss + w * class-centre loss (0: the queue
                                  # alone; the centres then get no gradient)

# --- precision ----------------------------------------------------------------------------
fp16: bool = False                # backbone in float16 autocast with a GradScaler (margin softmax stays float32)
bf16: bool = False                # backbone in bfloat16 autocast, no scaler needed (exclusive with fp16)

# --- hardware -----------------------------------------------------------------------------
device: Literal["auto", "cuda", "cpu"] = "auto"  # auto: this process's GPU when CUDA works, else the CPU (the
                                  # log says which); cuda: stop with the reason when CUDA cannot be used
tf32: bool = True                 # TF32 tensor cores for float32 matmuls and convolutions on GPUs (~10 bits mantissa)
deterministic: bool = False       # deterministic GPU kernels (slower): bitwise-exact resume on GPUs too
channels_last: bool = False       # ResNets: the backbone's weights in NHWC, so its convolutions run NHWC (tensor cores'
                                  # layout); off until measured on your GPU: bench_train --split (docs/gpu.md)
compile_backbone: Literal["default", "reduce-overhead", "max-autotune"] | None = None  # torch.compile of the
                                  # step's backbone in this mode ("reduce-overhead": also CUDA graphs); the first steps
                                  # wait for the compilation (minutes), cached in TORCHINDUCTOR_CACHE_DIR; None: eager
compile_margin_softmax: bool = False  # torch.compile the margin softmax's passes over the logits: each one fused
                                  # kernel (Triton on GPUs; a C++ compiler on CPUs); the first steps compile
                                  # (seconds, cached in TORCHINDUCTOR_CACHE_DIR), results equal up to float rounding
timeout_minutes: float = 30.0     # how long a rank waits at a collective (e.g. for a checkpoint being written)
network_check_seconds: float = 120.0  # several processes: joining the process group and one small all-reduce
                                  # before the first step must end within this, else each process stops with a line
                                  # naming what it waited for and its host's network (docs/failures.md); and a process
                                  # that lost a peer mid-run ends at most this long after its line

# --- optimisation -------------------------------------------------------------------------
optimizer: Literal["sgd", "adamw"] = "sgd"  # one optimizer, backbone and class centres as two param groups
lr: float = 0.1                   # learning rate of the GLOBAL batch batch_size * world_size * gradient_acc, as is:
                                  # like arcface_torch, nothing is rescaled when the number of processes changes
momentum: float = 0.9             # SGD momentum (ignored by adamw)
weight_decay: float = 5e-4        # the same for backbone and centres, as upstream
batch_size: int = 128             # records per process per forward (a record holds num_views images)
gradient_acc: int = 1             # forwards accumulated per optimizer step (loss divided, no DDP sync in between)
max_grad_norm: float = 5.0        # backbone gradient clipped to this L2 norm before each step
backbone_lr_mult: float = 1.0     # fine-tuning: the backbone's lr is this times the scheduled lr (the class
                                  # centres' is the scheduled lr itself), e.g. 0.1 to keep a trained backbone close
freeze_backbone_steps: int = 0    # fine-tuning: the first this many optimizer steps train the class centres alone;
                                  # the backbone runs in eval mode without gradients, so its weights AND its BatchNorm
                                  # statistics stay exactly as loaded (new centres first settle on good features)
freeze_backbone: bool = False     # fine-tuning: every step trains the class centres alone, as freeze_backbone_steps
                                  # does for the first ones (weights and BatchNorm statistics as loaded); not the
                                  # same as backbone_lr_mult = 0, which still moves the BatchNorm statistics
ema_decay: float = 0.0            # an exponential moving average of the backbone's weights at this decay (e.g. 0.999,
                                  # warmed up as (1 + n) / (10 + n) over the first steps): backbone.pth and verification
                                  # then use the averaged weights, saved and resumed with the rest; 0: off
num_epoch: int = 20               # passes over the data
warmup_epoch: int = 0             # linear warmup from 0 to lr, then polynomial decay (power lr_power) to 0 at the end;
                                  # negative (arcface_torch's 3millions.py: -1): no warmup, and its PolyScheduler
                                  # then starts the decay below lr, at ((T - step) / (T - warmup steps)) ** lr_power
lr_power: float = 2.0             # the decay's power: 2 is arcface_torch's PolyScheduler (its train.py), 1 the
                                  # PolynomialLRWarmup of its train_v2.py; on LFW, 3 seeds, 1 against 2 can't be told
                                  # apart (docs/training.md), so 2 stays, as every earlier run was trained
max_steps: int = 0                # stop after this many optimizer steps (0: run num_epoch); the LR schedule still
                                  # spans num_epoch. Steps of that schedule: renumbered by a resume on another
                                  # batch size or world size (the log says which shown step it is then)
max_nonfinite_steps: int = 10     # this many non-finite losses in a row stop the run (each one skips its step)
min_grad_scale: float = 1.0       # fp16: a step that leaves the grad scale below this counts towards
                                  # max_nonfinite_steps like a non-finite loss: a scale collapsing towards 0
                                  # (every step an overflow) freezes the loss, and would otherwise show only in the log

# --- logging and evaluation ---------------------------------------------------------------
frequent: int = 10                # a log line (speed, loss per view, lr, ETA) every this many steps
verbose: int = 2000               # verification on val_targets every this many steps (and at the end)
val_targets: tuple[str, ...] = () # .bin verification sets: names looked up as <rec>/<name>.bin, or paths
keep_best: str | None = None      # a val_targets set's name: keep the backbone.pth (and model.json) of the best
                                  # verification on it in <output>/best/, logged when it changes; None: off
using_wandb: bool = False         # also log to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline works)
wandb_key: str | None = None      # API key to log in with (None or arcface_torch's "XXX..." placeholder: wandb's own)
wandb_entity: str | None = None   # W&B entity (team or user); None: your default
wandb_project: str = "pairface"   # W&B project
wandb_log_all: bool = False       # a W&B run per process, not only rank 0's (the others log their config only)
wandb_resume: bool = False        # continue the last W&B run of this folder instead of starting a new one
suffix_run_name: str | None = None  # appended to the W&B run name <yymmdd_HHMM>_GPU<rank>
notes: str | None = None          # W&B run notes
save_artifacts: bool = False      # upload backbone.pth to W&B as a model artifact at each epoch end and at the end

# --- output and resume --------------------------------------------------------------------
output: str | None = None         # run folder (log, TensorBoard, checkpoint, backbone.pth); None: output/<config name>
save_all_states: bool = True      # write the full resumable checkpoint (False: only backbone.pth)
save_every_steps: int = 0         # also checkpoint every this many steps (0: at the end of each epoch only)
async_save: bool = True           # write checkpoints in a background thread: a save stalls the step only for a copy
                                  # of the state to host memory (counted in the --dry-run memory plan)
resume: bool | str = False        # True: continue the run in `output`; "auto": continue it if there is one, else start
                                  # it (a script that starts and restarts the same command); a path: start from that
                                  # run folder (also arcface_torch's), checkpoint.json or bare backbone.pth into a new
                                  # output. torchrun's restarts of a run continue it whatever this says.
                                  # Continuing a run keeps the --set values it was started with (config.json)
