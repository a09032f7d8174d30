"""`python -m strata.services.registry`: run the registry (as in its container)."""

from strata.config import load_settings
from strata.services.registry.service import create
from strata.services.runtime import run

if __name__ == "__main__":
    run(create(), load_settings())
