"""`python -m strata.services.sharding`: run the sharding service (as in its container)."""

from strata.config import load_settings
from strata.services.runtime import run
from strata.services.sharding.service import create

if __name__ == "__main__":
    run(create(), load_settings())
