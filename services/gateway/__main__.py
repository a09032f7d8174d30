"""`python -m strata.services.gateway`: run the gateway (as in its container)."""

from strata.config import load_settings
from strata.services.gateway.service import Gateway
from strata.services.runtime import run

if __name__ == "__main__":
    run(Gateway(), load_settings())
