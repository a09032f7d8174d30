"""`python -m strata.services.barrier`: run the barrier service (as in its container)."""

from strata.config import load_settings
from strata.services.barrier.service import create
from strata.services.runtime import run

if __name__ == "__main__":
    run(create(), load_settings())
