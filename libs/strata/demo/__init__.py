"""`strata demo`: a real PyTorch training job on a local stack, one worker killed midway."""
