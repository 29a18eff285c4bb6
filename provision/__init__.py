"""Machine provisioning: makes a bare GPU machine ready for the device check (`python3 -m provision.gpu_wheels`)."""
