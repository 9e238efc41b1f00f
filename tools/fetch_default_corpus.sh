#!/usr/bin/env bash
# Fetches the public text that tools/train_default.py trains the built-in default model on, into the
# git-ignored folder .corpus/ (text/*.txt + SOURCES.md + licenses/). Debian packages only, by name with
# apt-get download (no other downloads); plus Shakespeare's sonnets from the shared data folder.
# Run on a machine with Debian's package lists (apt-get update once); the H200 machine has no network,
# so the lead carries .corpus/ there.
#
#   tools/fetch_default_corpus.sh [--sonnets PATH] [--out DIR]
#
# Output (all UTF-8; documents separated by a line holding only '%', the fortune-file convention):
#   text/kjv.txt         King James Bible, one chapter per document ("Genesis 1" heading, verse per line)
#   text/sonnet.txt      Shakespeare's sonnets, one sonnet (14 lines) per document
#   text/fortunes_en.txt English fortune cookies (fortunes, fortunes-min)
#   text/fortunes_de.txt German (fortunes-de)     text/fortunes_es.txt Spanish (fortunes-es, not off/)
#   text/fortunes_it.txt Italian (fortunes-it)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SONNETS="$ROOT/../shared/data/sonnet.txt"
[[ -f "$SONNETS" ]] || SONNETS=/work/shared/data/sonnet.txt
OUT="$ROOT/.corpus"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sonnets) SONNETS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "fetch_default_corpus.sh: unknown argument '$1' (expected --sonnets PATH, --out DIR)" >&2; exit 2 ;;
  esac
done
[[ -f "$SONNETS" ]] || { echo "fetch_default_corpus.sh: no sonnets file at '$SONNETS' (pass --sonnets PATH)" >&2; exit 1; }

# .corpus/ never enters git (the default path only; a custom --out is the caller's business).
if [[ "$OUT" == "$ROOT/.corpus" && -d "$ROOT/.git" ]] && ! grep -qx '/.corpus/' "$ROOT/.git/info/exclude" 2>/dev/null; then
  echo '/.corpus/' >> "$ROOT/.git/info/exclude"
fi

# bible-kjv holds the `bible` reader that decodes bible-kjv-text's compressed data file.
PACKAGES=(bible-kjv-text bible-kjv fortunes fortunes-min fortunes-de fortunes-es fortunes-it)
DEB="$OUT/deb"
rm -rf "$OUT/text" "$OUT/licenses" "$OUT/root"
mkdir -p "$DEB" "$OUT/text" "$OUT/licenses" "$OUT/root"
( cd "$DEB" && for p in "${PACKAGES[@]}"; do ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p"; done )
for p in "${PACKAGES[@]}"; do
  deb=$(ls "$DEB/${p}"_*.deb | head -n1)
  dpkg -x "$deb" "$OUT/root"
  cp "$OUT/root/usr/share/doc/$p/copyright" "$OUT/licenses/$p.copyright"
done
X="$OUT/root"

# King James Bible: one verse per line (-l9999: no wrapping), a chapter per document.
"$X/usr/bin/bible" -l9999 -p "$X/usr/lib" "gen1:1-rev22:21" | python3 -c '
import re, sys
docs, cur = [], []
for line in sys.stdin.read().splitlines():
    line = line.rstrip()
    if not line:
        continue
    m = re.match(r"^\s+(\d+) (.*)$", line)
    if m:
        cur.append(m.group(2))
    else:  # a chapter heading such as "Genesis 1"
        if cur:
            docs.append("\n".join(cur))
        cur = [line.strip()]
if cur:
    docs.append("\n".join(cur))
sys.stdout.write("\n%\n".join(docs) + "\n")
' > "$OUT/text/kjv.txt"

# Sonnets: 14 lines each.
python3 - "$SONNETS" > "$OUT/text/sonnet.txt" <<'PY'
import sys
lines = [l.rstrip() for l in open(sys.argv[1], encoding="utf-8") if l.strip()]
docs = ["\n".join(lines[i:i + 14]) for i in range(0, len(lines), 14)]
sys.stdout.write("\n%\n".join(docs) + "\n")
PY

# Fortune files: regular UTF-8 files (no .dat indexes, no links, no offensive off/ folders, no ASCII art).
fortunes() {  # fortunes OUTFILE DIR...
  local out="$1"; shift
  python3 - "$@" > "$out" <<'PY'
import os, sys
SKIP = {"ascii-art", "asciiart", "banner", "translate-me"}
docs = []
for d in sys.argv[1:]:
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if os.path.islink(path) or not os.path.isfile(path) or name.endswith((".dat", ".u8")) or name in SKIP:
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        for doc in text.replace("\r", "").split("\n%\n"):
            doc = doc.strip("\n%").rstrip()
            if doc.strip() and "\x1b" not in doc:
                docs.append(doc)
sys.stdout.write("\n%\n".join(docs) + "\n")
PY
}
fortunes "$OUT/text/fortunes_en.txt" "$X/usr/share/games/fortunes"
fortunes "$OUT/text/fortunes_de.txt" "$X/usr/share/games/fortunes/de"
fortunes "$OUT/text/fortunes_es.txt" "$X/usr/share/games/fortunes/es"
fortunes "$OUT/text/fortunes_it.txt" "$X/usr/share/games/fortunes/it"

{
  echo "# Corpus of the default model (made by tools/fetch_default_corpus.sh)"
  echo
  echo "| package | version | sha256 of the .deb |"
  echo "|---|---|---|"
  for p in "${PACKAGES[@]}"; do
    deb=$(ls "$DEB/${p}"_*.deb | head -n1)
    echo "| $p | $(dpkg-deb -f "$deb" Version) | $(sha256sum "$deb" | cut -c1-16)… |"
  done
  echo
  echo "sonnet.txt: $SONNETS (sha256 $(sha256sum "$SONNETS" | cut -c1-16)…), Shakespeare's sonnets, public domain."
  echo
  echo "Licenses (licenses/*.copyright, from each package): the King James text is out of copyright (1611);"
  echo "fortunes and fortunes-min: BSD (4.4BSD games); fortunes-de: GPL-2+; fortunes-es: GPL-2+ for the"
  echo "package, its texts presumed public domain; fortunes-it: public domain. The fortune files are mostly"
  echo "quotations. The model and adapters hold weights trained on these texts, not the texts."
  echo
  echo "| file | documents | bytes |"
  echo "|---|---|---|"
  for f in "$OUT"/text/*.txt; do
    echo "| $(basename "$f") | $(grep -cx '%' "$f" | awk '{print $1 + 1}') | $(wc -c < "$f") |"
  done
} > "$OUT/SOURCES.md"
rm -rf "$OUT/root"
cat "$OUT/SOURCES.md"
