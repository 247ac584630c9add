import os
import sys

# shared float64 references live beside the tests (tests/reference.py)
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# reference comparisons must never run under TF32
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
