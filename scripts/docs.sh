#!/usr/bin/env bash
# Build the docs site into site/ (mkdocs, warnings are errors: a broken link or a missing page
# fails), or preview it: scripts/docs.sh serve [ADDR]. The docs' dependencies (the `docs` extra
# of pyproject.toml) are installed into .venv when missing; scripts/setup.sh makes .venv.
# --out DIR builds into DIR instead of site/.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
VPY=.venv/bin/python
if ! "$VPY" -c "import mkdocs, material, mkdocstrings_handlers.python, mkdocs_gen_files, matplotlib" >/dev/null 2>&1; then
  echo "docs: installing the docs extra into .venv"
  "$VPY" -m pip install -q --disable-pip-version-check -e ".[docs]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import mkdocs, material, mkdocstrings_handlers.python, mkdocs_gen_files, matplotlib" \
    || { echo "docs: the docs extra could not be installed (pip install -e '.[docs]')" >&2; exit 1; }
fi
# Diagrams: mermaid's script, from the npm registry, so the site draws them offline (without it the
# theme loads mermaid from a CDN when a page is viewed). Pinned; kept in .venv between builds.
MERMAID=11.12.0
CACHE=.venv/.docs-cache
if [ ! -s "$CACHE/mermaid-$MERMAID.min.js" ] && command -v npm >/dev/null 2>&1; then
  mkdir -p "$CACHE"
  if (cd "$CACHE" && npm pack "mermaid@$MERMAID" --silent >/dev/null 2>&1 \
        && tar xzf "mermaid-$MERMAID.tgz" package/dist/mermaid.min.js \
        && mv package/dist/mermaid.min.js "mermaid-$MERMAID.min.js"); then
    rm -rf "$CACHE/package" "$CACHE/mermaid-$MERMAID.tgz"
  else
    echo "docs: mermaid $MERMAID could not be fetched with npm; pages will load it when viewed"
  fi
fi
export FTRUN_DOCS_MERMAID="$PWD/$CACHE/mermaid-$MERMAID.min.js"
# Generated pages run `ftrun --help`; matplotlib writes its cache under the venv, not $HOME.
export MPLCONFIGDIR="${MPLCONFIGDIR:-$PWD/.venv/.matplotlib}"
# Quiet the packages' notices about their own future (they are not about this site).
export NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true
if [ "${1:-}" = "serve" ]; then
  shift
  exec "$VPY" -m mkdocs serve --strict --dev-addr "${1:-127.0.0.1:8000}"
fi
out=site
if [ "${1:-}" = "--out" ]; then out=$2; fi
# Not --quiet: mkdocs then stops counting warnings, and --strict would pass a broken link.
"$VPY" -m mkdocs build --strict --site-dir "$out" 2>&1 | { grep -v "^INFO" || true; }
echo "docs: built into $out/"
