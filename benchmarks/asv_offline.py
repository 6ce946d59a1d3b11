"""Make a published asv dashboard work offline: serve its CDN scripts and styles from results/html/vendor/.

    python benchmarks/asv_offline.py [results/html]

asv's index.html loads jQuery, flot, bootstrap and friends from CDNs; on a machine without internet the page
only shows "Can not determine continental origin of swallow". This copies the vendored files
(benchmarks/asv_vendor/) next to the dashboard and rewrites the URLs (dropping the CDN's integrity hashes,
which pin the CDN's own minified builds). Idempotent.
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

VENDOR = Path(__file__).resolve().parent / "asv_vendor"
#: file name at the end of each CDN URL -> vendored file
LOCAL = {
    "jquery-3.3.1.min.js": "jquery.min.js",
    "jquery.flot.min.js": "jquery.flot.js",
    "jquery.flot.time.min.js": "jquery.flot.time.js",
    "jquery.flot.selection.min.js": "jquery.flot.selection.js",
    "jquery.flot.categories.min.js": "jquery.flot.categories.js",
    "jquery.flot.orderBars.js": "jquery.flot.orderBars.js",
    "stupidtable.min.js": "stupidtable.min.js",
    "md5.min.js": "md5.min.js",
    "bootstrap.min.js": "bootstrap.min.js",
    "bootstrap.min.css": "bootstrap.min.css",
}


def localise(html_dir: Path) -> list[str]:
    """Copy the vendored assets and rewrite index.html; returns the URLs that were replaced."""
    index = html_dir / "index.html"
    text = index.read_text()
    target = html_dir / "vendor"
    target.mkdir(exist_ok=True)
    replaced = []

    def swap(match):
        url = match.group(2)
        name = url.rsplit("/", 1)[-1]
        if name not in LOCAL:
            raise SystemExit(f"asv_offline: no vendored copy for {url}; add it to benchmarks/asv_vendor")
        shutil.copy2(VENDOR / LOCAL[name], target / LOCAL[name])
        replaced.append(url)
        return f'{match.group(1)}="vendor/{LOCAL[name]}"'

    text = re.sub(r'(src|href)="(https://[^"]+\.(?:js|css))"', swap, text)
    # the CDN tags pin subresource-integrity hashes of the CDN's minified builds; local copies are checked in
    text = re.sub(r'(<(?:script|link)[^>]*"vendor/[^"]+"[^>]*?)\s+integrity="[^"]*"', r"\1", text)
    tmp = index.with_suffix(".html.tmp")
    tmp.write_text(text)
    tmp.replace(index)
    return replaced


if __name__ == "__main__":
    html = Path(sys.argv[1] if len(sys.argv) > 1 else "results/html")
    urls = localise(html)
    print(f"asv_offline: {len(urls)} CDN assets now served from {html / 'vendor'}")
