"""`python -m strata.services.checkpoint`: run the checkpoint service (as in its container)."""

from strata.config import load_settings
from strata.services.checkpoint.service import create
from strata.services.runtime import run

if __name__ == "__main__":
    run(create(), load_settings())
