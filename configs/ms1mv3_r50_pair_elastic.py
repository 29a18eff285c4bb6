"""configs/ms1mv3_r50_pair.py with ElasticFace-Arc: each image's margin drawn from N(0.5, 0.05) per step.

    torchrun --nproc_per_node=8 train.py configs/ms1mv3_r50_pair_elastic.py

The draws depend on the seed, the step and the image's place in the global batch alone, so any number
of processes draws the same margins. --set elastic_plus=True is ElasticFace-Arc+ (std 0.0175 unless
elastic_std says otherwise); --set margin_family=elastic_cos the CosFace variant (m 0.35).
"""
rec = "/train_tmp/ms1mv3_pair"
num_views = 2
view_source = "record"
num_classes = 93431
network = "r50"
margin_family = "elastic_arc"
elastic_m = 0.5
elastic_std = 0.05
fp16 = True
lr = 0.1
batch_size = 128
num_epoch = 20
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/ms1mv3_r50_pair_elastic"
