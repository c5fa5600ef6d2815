"""The optimizers' math, one module each (kfac, shampoo, soap, muon), and the stage optimizer that
applies their update directions with AdamW on the rest (stage)."""
