# arcface_torch's configs/ms1mv3_r50_onegpu.py as insightface ships it, in its own style (an edict named config),
# with rec = "synthetic" and no val_targets: the file gpu_acceptance/side_by_side.py gives to both arcface_torch's
# train_v2.py and pairface's train.py by default, so that both read the same values (no data needed: a speed
# comparison).
# Synthetic data has no verification sets: arcface_torch skips the sets it cannot find without a word, pairface
# stops at a listed set that is missing, so the list is empty here, which means the same in both.
from easydict import EasyDict as edict

# make training faster
# our RAM is 256G
# mount -t tmpfs -o size=140G  tmpfs /train_tmp

config = edict()
config.margin_list = (1.0, 0.5, 0.0)
config.network = "r50"
config.resume = False
config.output = None
config.embedding_size = 512
config.sample_rate = 1.0
config.fp16 = True
config.momentum = 0.9
config.weight_decay = 5e-4
config.batch_size = 128
config.lr = 0.02
config.verbose = 2000
config.dali = False

config.rec = "synthetic"
config.num_classes = 93431
config.num_image = 5179510
config.num_epoch = 20
config.warmup_epoch = 0
config.val_targets = []
