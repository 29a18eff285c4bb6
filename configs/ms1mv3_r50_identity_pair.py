"""Two views per sample from the plain MS1MV3 .rec: each record plus another image of the same
identity, drawn from the .rec's identity table (no re-packing needed), r50, 8 GPUs.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_identity_pair.py
"""
rec = "/train_tmp/ms1m-retinaface-t1"   # the plain 112x112 MS1MV3 .rec (its header holds the identity table)
num_views = 2
view_source = "identity"
num_classes = 93431
network = "r50"
margin_list = (1.0, 0.5, 0.0)
fp16 = True
lr = 0.1
weight_decay = 5e-4
batch_size = 128                   # records per GPU: 256 images per GPU per step
num_epoch = 20                     # an epoch still walks every image once as the first view
num_workers = 4                    # two decodes per sample
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/ms1mv3_r50_identity_pair"
