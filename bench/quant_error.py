"""Quantization error and bytes per parameter of every packed format (relative Frobenius error vs the input).

    python bench/quant_error.py            # CPU is fine: this is numerics, not speed
"""

from orbit_lightning.quant.formats import print_error_table

if __name__ == "__main__":
    print_error_table(shape=(1024, 4096), std=0.02, seed=0)
