"""Semi-Siamese Training as its paper trains it, on 8 GPUs: MS-Celeb-1M's shallow split (two photos per person,
packed as one two-view record each), r50, FaceX-Zoo's SST head (CosFace, s = 32, m = 0.35; a queue of 16384
gallery features; gallery momentum 0.999).

    torchrun --nproc_per_node=8 train.py configs/ms1m_shallow_r50_sst.py

For training sets where most identities have one or two photos: there a learned centre per identity is fitted
to the one or two photos it sees, and SST's queue of another network's features of the other photo generalises
better (docs/training.md). The queue is sharded over the 8 processes (2048 slots each) like class centres; the
gallery's BatchNorm batches are shuffled across the global batch. FaceX-Zoo trains 250 epochs at a batch of 512
images with step decay; this recipe keeps pairface's polynomial decay over the same number of epochs, at 8 x 128
records (2048 images) a step.
"""
rec = "/train_tmp/ms1m_shallow_pair"  # train.rec/train.idx of 112x224 records (a person's two photos), lfw.bin ...
num_views = 2
view_source = "record"
network = "r50"
margin_list = (1.0, 0.0, 0.35)     # FaceX-Zoo's am_softmax head for SST
margin_scale = 32.0
fp16 = True
optimizer = "sgd"
lr = 0.1
momentum = 0.9
weight_decay = 5e-4
batch_size = 128                   # records per GPU: 8 x 128 = 1024 gallery features enqueued a step
num_epoch = 250
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/ms1m_shallow_r50_sst"
sst = True
sst_queue_size = 16384             # FaceX-Zoo's; a multiple of the 1024 features a step enqueues
sst_momentum = 0.999
sst_enqueue = "one"
