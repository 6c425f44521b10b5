"""Run as a user who may not write into FOLDER (``setpriv --reuid``): load FOLDER/good, then
save FOLDER/bad (EACCES), and save OTHER/big under a 64-byte file-size limit (EFBIG). Prints
one JSON line: each save's error class and message, and whether the load was bitwise."""

from __future__ import annotations

import json
import resource
import signal
import sys

import torch

from scenarios.checkpoints import fresh


def _error(call: object) -> dict[str, str]:
    try:
        call()  # type: ignore[operator]
    except Exception as err:
        return {"kind": type(err).__name__, "error": str(err)}
    return {"kind": "", "error": ""}


def main() -> None:
    folder, other, expected = sys.argv[1:4]
    accel, model, *_ = fresh()
    accel.load_state(f"{folder}/good")
    want = torch.load(expected)
    out: dict[str, object] = {
        "bitwise": all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    }
    out["eacces"] = _error(lambda: accel.save_state(f"{folder}/bad"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
    out["efbig"] = _error(lambda: accel.save_state(f"{other}/big"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out["after"] = _error(lambda: accel.save_state(f"{other}/after"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
