"""Suite-wide settings: the test models are tiny, so one intra-op thread is fastest and
keeps tests from oversubscribing the (2-core) machine."""

import torch

torch.set_num_threads(1)
