"""AdaFace as its paper trains it: WebFace4M, r100, m=0.4, h=0.333, s=64, single view, 8 GPUs.

    torchrun --nproc_per_node=8 train.py configs/webface4m_r100_adaface.py

The margin reads each image's feature norm against EMAs of the global batch's norm statistics (docs/training.md:
margin families). The paper's own schedule is 26 epochs of step decay at a global batch of 512; this
recipe keeps arcface_torch's (polynomial decay, 20 epochs, 8 x 128 images) so that it compares with
arcface_torch's wf4m_r100 run, which differs from it in the margin alone.
"""
rec = "/train_tmp/WebFace4M"
num_classes = 205990
num_image = 4235242
network = "r100"
margin_family = "adaface"
adaface_m = 0.4
adaface_h = 0.333
adaface_t_alpha = 0.01
margin_scale = 64.0
fp16 = True
lr = 0.1
batch_size = 128
num_epoch = 20
val_targets = ("lfw", "cfp_fp", "agedb_30")
output = "output/webface4m_r100_adaface"
