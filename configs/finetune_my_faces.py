"""Fine-tune a trained backbone on your own people: the README's "Fine-tune on your own people".

    python -m tools.pack_rec photos/ data/my_faces --views 2 --crop
    python -m tools.make_bin photos_val/ data/my_faces/my_faces_val.bin --random 50 --crop
    python train.py configs/finetune_my_faces.py --set resume=path/to/backbone.pth

`resume` names a bare backbone (pairface's backbone.pth, arcface_torch's model.pt or backbone.pth): the run
starts from its weights with new class centres for your people, a new optimizer and schedule. The network keys
must be the backbone's: a pairface backbone.pth brings them in the model.json beside it, which replaces the ones
below where they differ (the log says so; the demo's and configs/my_faces.py's are r18 at 1/16 width); a backbone
without one keeps these, and one that does not fit them stops the run with the --set line that does
(arcface_torch's ms1mv3 r50: --set network=r50 --set "network_kwargs={}" --set embedding_size=512). The rest are
experiments.fine_tune's: the recipe it measured (docs/training.md: the table) from an r18 at 1/8 width, as
configs/lfw_r18_pair.py trains it on LFW.
"""
rec = "data/my_faces"              # tools.pack_rec's output, with my_faces_val.bin beside it
num_views = 2
view_source = "record"
resume = "output/lfw_r18_pair/backbone.pth"  # the trained backbone to start from
network = "r18"
network_kwargs = {"width_mult": 0.125}
embedding_size = 128
margin_list = (1.0, 0.0, 0.35)     # CosFace
margin_scale = 32.0
optimizer = "adamw"
lr = 0.002                         # the new class centres' lr
backbone_lr_mult = 0.1             # the trained backbone moves 10x slower than the new centres
freeze_backbone_steps = 18         # the new centres first settle on the trained features, the backbone untouched:
                                   # 18 steps of 32 records, an epoch of experiments.fine_tune's 298 people (576
                                   # records), 6 epochs of a few dozen people's (about 100); the log says which
warmup_epoch = 0
weight_decay = 0.05
batch_size = 32                    # records: 64 photos per step
num_epoch = 20
num_workers = 0                    # decoding in-line: a worker would take a core from the backbone (2-core CPU)
frequent = 10
verbose = 50
val_targets = ("my_faces_val",)    # tools.make_bin's set of people kept out of training
