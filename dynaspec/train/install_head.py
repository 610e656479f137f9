"""Install a head a device run returned as the one `--speculator eagle` uses by default.

  python -m dynaspec.train.install_head OUT/head [--dest DIR] [--model default]

Checks the head loads for the target (shapes, vocabulary maps), then writes it into DIR (the
shipped head's folder by default) as one model.safetensors + config.json, the shards joined.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def install(src: str, dest: str, model: str = "default") -> str:
    from safetensors.torch import save_file

    from dynaspec.models.loader import resolve_model_path
    from dynaspec.spec_decode.drafters.eagle_io import load_head, read_weights

    path, kind = resolve_model_path(model)
    if kind == "gguf":
        from dynaspec.models.gguf_loader import arch_from_gguf
        from dynaspec.models.gguf_reader import GGUFMetadata, open_gguf

        reader = open_gguf(path)
        arch = arch_from_gguf(GGUFMetadata(reader, path), reader)
    else:
        from dynaspec.models.loader import load_model_files

        arch = load_model_files(path).arch
    load_head(src, arch)  # refuses a head that does not fit, naming what differs
    sd = read_weights(src)
    tmp = dest.rstrip("/") + ".new"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    load_head(tmp, arch)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)  # package data: readable by every user
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    from dynaspec.spec_decode.drafters.eagle import DEFAULT_HEAD

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="the returned head folder (config.json + safetensors or shards)")
    p.add_argument("--dest", default=DEFAULT_HEAD, help="where to install it")
    p.add_argument("--model", default="default", help="the target it must fit")
    a = p.parse_args(argv)
    print(f"installed {install(a.src, a.dest, a.model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
