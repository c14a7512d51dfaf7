"""A stand-in for PyTorch's CPU index (PEP 503 pages with PEP 658 metadata), for where it cannot be reached.

It lists the torch files recorded in scripts/torch-cpu-wheels.txt with their sha256, serves each file's
metadata (the METADATA of the torch installed beside this interpreter, or of --metadata-from), and serves
a file itself only when it lies in one of the --wheels folders. A resolver (pip --dry-run, uv pip compile)
needs no more than that; an install needs the file on disk. Standard library only.

    python scripts/torch_index.py [--port 0] [--wheels DIR ...]   prints its URL on the first line
"""

from __future__ import annotations

import argparse
import hashlib
import http.server
import importlib.metadata
import sys
import zipfile
from pathlib import Path
from urllib.parse import quote, unquote

LIST = Path(__file__).with_name("torch-cpu-wheels.txt")


def recorded(path: Path = LIST) -> dict[str, str]:
    """File name -> sha256 of every torch file the locks allow from PyTorch's CPU index."""
    files = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, digest = line.split()
            files[name] = digest
    return files


def installed_metadata() -> bytes:
    """METADATA of the torch installed beside this interpreter; LookupError when there is none."""
    try:
        text = importlib.metadata.distribution("torch").read_text("METADATA")
    except importlib.metadata.PackageNotFoundError as exc:
        raise LookupError("torch is not installed beside this interpreter: pass --metadata-from") from exc
    if text is None:
        raise LookupError("the installed torch has no METADATA")
    return text.encode()


def wheel_metadata(wheel: Path) -> bytes:
    """METADATA inside a wheel file."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        return archive.read(name)


class Index(http.server.BaseHTTPRequestHandler):
    """GET / (the project list), /torch/ (its files), /torch/<file>.metadata and /torch/<file>."""

    files: dict[str, str] = {}
    metadata: bytes = b""
    wheels: list[Path] = []

    def do_GET(self) -> None:  # noqa: N802 (BaseHTTPRequestHandler's name)
        path = unquote(self.path.split("?")[0])
        if path in ("/", ""):
            self._send(b'<!DOCTYPE html><html><body><a href="torch/">torch</a></body></html>\n')
        elif path in ("/torch/", "/torch"):
            self._send(self._page())
        elif path.startswith("/torch/") and path.endswith(".metadata") and path[7:-9] in self.files:
            self._send(self.metadata, "application/octet-stream")
        elif path.startswith("/torch/") and path[7:] in self.files:
            found = [d / path[7:] for d in self.wheels if (d / path[7:]).is_file()]
            if found:
                self._send(found[0].read_bytes(), "application/octet-stream")
            else:
                self.send_error(404, "this stand-in lists the file but does not hold it")
        else:
            self.send_error(404)

    def _page(self) -> bytes:
        meta = hashlib.sha256(self.metadata).hexdigest()
        links = "".join(
            f'<a href="{quote(name)}#sha256={digest}" data-dist-info-metadata="sha256={meta}" '
            f'data-core-metadata="sha256={meta}">{name}</a><br>\n'
            for name, digest in self.files.items()
        )
        return f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode()

    def _send(self, body: bytes, kind: str = "text/html") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--wheels", type=Path, action="append", default=[], help="a folder of wheels to serve")
    parser.add_argument("--metadata-from", type=Path, help="a torch wheel whose METADATA to serve")
    args = parser.parse_args(argv)
    Index.files = recorded()
    Index.metadata = wheel_metadata(args.metadata_from) if args.metadata_from else installed_metadata()
    Index.wheels = args.wheels
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Index)
    print(f"http://127.0.0.1:{server.server_address[1]}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
