"""`python -m infer.parity DIR [--dtype float32]`: see `infer.parity.check`."""
from infer.parity.check import main

if __name__ == "__main__":
    raise SystemExit(main())
