"""Packs static binaries into a one-layer image archive (docker-archive, what `ctr image import` and `podman load`
read), FROM scratch, byte for byte the same for the same inputs: no registry, no image builder.

Usage: image_archive.py REFERENCE OUTPUT.tar --entrypoint /NAME [--user UID:GID] BINARY...
Each BINARY lands at /<its file name>; the image also has an empty /tmp (mode 1777) for programs that write there.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
from pathlib import Path


def _layer(binaries: list[Path]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(tmp)
        for binary in binaries:
            info = tarfile.TarInfo(binary.name)
            data = binary.read_bytes()
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_archive(reference: str, output: Path, entrypoint: list[str], user: str, binaries: list[Path]) -> None:
    layer = _layer(binaries)
    layer_digest = hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "User": user, "Env": ["PATH=/"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
    }, sort_keys=True).encode()
    config_name = f"{hashlib.sha256(config).hexdigest()}.json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [reference],
                            "Layers": [f"{layer_digest}/layer.tar"]}]).encode()
    partial = output.with_name(output.name + ".partial")
    with tarfile.open(partial, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, f"{layer_digest}/layer.tar", layer)
        _add(tar, config_name, config)
        _add(tar, "manifest.json", manifest)
    partial.replace(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("output", type=Path)
    parser.add_argument("--entrypoint", required=True)
    parser.add_argument("--user", default="65535:65535")
    parser.add_argument("binaries", nargs="+", type=Path)
    args = parser.parse_args()
    write_archive(args.reference, args.output, [args.entrypoint], args.user, args.binaries)


if __name__ == "__main__":
    main()
