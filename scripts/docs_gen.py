"""mkdocs-gen-files entry (mkdocs.yml): writes the generated reference pages and the benchmark plots
into the site being built. The pages come from scripts/docs_reference.py, the plots from
scripts/docs_plots.py; nothing is written into docs/ itself."""

import os
import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_plots  # noqa: E402
import docs_reference  # noqa: E402

for path, render in docs_reference.PAGES.items():
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(render())
    mkdocs_gen_files.set_edit_path(path, "scripts/docs_reference.py")

for path, svg in docs_plots.plots(Path(__file__).resolve().parent.parent / "docs").items():
    with mkdocs_gen_files.open(path, "w") as f:
        f.write(svg)

# mermaid's script, fetched by scripts/docs.sh: the theme uses it instead of loading it from a CDN.
mermaid = Path(os.environ.get("FTRUN_DOCS_MERMAID", ""))
if mermaid.is_file():
    with mkdocs_gen_files.open("assets/mermaid.min.js", "w") as f:
        f.write(mermaid.read_text())
