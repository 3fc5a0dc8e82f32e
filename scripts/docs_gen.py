"""mkdocs-gen-files entry (mkdocs.yml): writes mermaid's script into the site being built. The
reference pages, the guides' diffs and the benchmark plots are committed under docs/
(scripts/docs_reference.py --write makes them, and a test fails while one is stale); nothing is
written into docs/ itself."""

import os
from pathlib import Path

import mkdocs_gen_files

# mermaid's script, fetched by scripts/docs.sh: the theme uses it instead of loading it from a CDN.
mermaid = Path(os.environ.get("FTRUN_DOCS_MERMAID", ""))
if mermaid.is_file():
    with mkdocs_gen_files.open("assets/mermaid.min.js", "w") as f:
        f.write(mermaid.read_text())
