"""One process of a multi-process test: runs train_lm, recording the global indices this process's
training loader requests (``LEVANTER_TEST_RECORD``). Not a test module itself."""

import json
import os
import sys


def main() -> None:
    import logging

    import jax

    logging.basicConfig(level=logging.INFO)

    from levanter.data.loader import DataLoader
    from levanter.main import train_lm

    record = os.environ.get("LEVANTER_TEST_RECORD")
    original = DataLoader.fetch

    async def fetch(self, step, *args, **kwargs):
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"process": jax.process_index(), "step": step,
                                    "indices": self.indices_for_step(step).tolist()}) + "\n")
        return await original(self, step, *args, **kwargs)

    DataLoader.fetch = fetch
    train_lm.cli(argv=sys.argv[1:])


if __name__ == "__main__":
    main()
