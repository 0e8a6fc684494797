"""Regenerate the Python code of ``generation.proto`` (or, with ``--check``, verify it is current).

    python -m tandem.proto.generate           # rewrite generation_pb2{,_grpc}.py{,i} here
    python -m tandem.proto.generate --check   # exit 1 if the checked-in files are stale

protoc names imports after the path it was given, and this folder is installed as the
package ``tandem.proto``. So the .proto is compiled from a temporary include tree
``tandem/proto/generation.proto``: the grpc module then says
``from tandem.proto import generation_pb2``, which works once installed (a bare
``import generation_pb2`` would not).
"""

from __future__ import annotations

import argparse
import filecmp
import logging
import shutil
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "generation.proto"
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")
PACKAGE_PATH = Path("tandem") / "proto"


def generate_into(out_dir: Path) -> list[Path]:
    """Compile generation.proto into ``out_dir`` -> the generated files (named as in GENERATED)."""
    # grpc_tools is a build-time tool: imported here so importing tandem.proto stays cheap.
    import grpc_tools
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="tandem-proto-") as tmp:
        include = Path(tmp) / "include"
        build = Path(tmp) / "build"
        (include / PACKAGE_PATH).mkdir(parents=True)
        build.mkdir()
        shutil.copyfile(PROTO_FILE, include / PACKAGE_PATH / PROTO_FILE.name)
        well_known = Path(grpc_tools.__file__).parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{include}",
            f"-I{well_known}",
            f"--python_out={build}",
            f"--pyi_out={build}",
            f"--grpc_python_out={build}",
            str(PACKAGE_PATH / PROTO_FILE.name),
        ]
        # protoc resolves the file argument against the include path, not the cwd.
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copyfile(build / PACKAGE_PATH / name, target)
            written.append(target)
    return written


def stale_files() -> list[str]:
    """Regenerate into a temporary folder -> names of checked-in files that differ or are missing."""
    with tempfile.TemporaryDirectory(prefix="tandem-proto-check-") as tmp:
        generate_into(Path(tmp))
        return [
            name for name in GENERATED
            if not (PROTO_DIR / name).is_file()
            or not filecmp.cmp(Path(tmp) / name, PROTO_DIR / name, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.proto.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temporary folder; exit 1 if the checked-in files differ")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.check:
        stale = stale_files()
        if stale:
            logger.error("stale generated code (%s): run `python -m tandem.proto.generate`", ", ".join(stale))
            return 1
        logger.info("generated code is in step with %s", PROTO_FILE.name)
        return 0
    for path in generate_into(PROTO_DIR):
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
