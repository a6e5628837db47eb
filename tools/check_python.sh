#!/usr/bin/env bash
# Does labkit install and pass its unit tests under another Python? (issue 38: requires-python
# says what runs, checked for real)
#
#   bash tools/check_python.sh PYTHON [PYTHON ...]     e.g. ~/.pyenv/versions/3.13.0/bin/python
#
# For each interpreter: a fresh venv in a temporary folder, `pip install '.[test]'` of this
# checkout (its declared dependencies, resolved for that Python), then, if pip installed it,
# the unit tests (`pytest -m unit`, what `make test-fast` runs) in the checkout on that venv.
# A version that pyproject.toml's requires-python excludes must be refused by pip, with pip's
# "requires a different Python" line; anything else is a failure. One line per interpreter,
# exit 1 if any failed. Logs stay in the temporary folder, named in the line; each venv (6 GB
# with torch's CUDA libraries) is removed once its interpreter is checked.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: bash tools/check_python.sh PYTHON [PYTHON ...]" >&2; exit 2; }
work=$(mktemp -d -t labkit-pythons.XXXXXX)
failed=0
check() {  # one interpreter: prints its line, returns non-zero on a failure
  local py=$1 ver admitted venv log start
  ver=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) \
    || { echo "$py: not a Python that runs"; return 1; }
  admitted=$("$py" -c 'import sys, re; spec = re.search(r"requires-python\s*=\s*\">=(\d+)\.(\d+)", open(sys.argv[1]).read()); print(int(sys.version_info[:2] >= tuple(map(int, spec.groups()))))' "$root/pyproject.toml")
  venv="$work/venv-$ver"; log="$work/$ver.log"; start=$(date +%s)
  "$py" -m venv "$venv" >"$log" 2>&1 || { echo "Python $ver: cannot create a venv (see $log)"; return 1; }
  # pip builds the wheel from the checkout (its build/ and *.egg-info are git-ignored)
  if ! "$venv/bin/pip" install "$root[test]" >>"$log" 2>&1; then
    if [ "$admitted" = 0 ] && grep -q "requires a different Python" "$log"; then
      echo "Python $ver: refused by pip as requires-python says ($(grep -o 'requires a different Python.*' "$log" | head -1))"
      return 0
    fi
    echo "Python $ver: install FAILED (see $log)"; return 1
  fi
  if [ "$admitted" = 0 ]; then
    echo "Python $ver: installed although requires-python excludes it (see $log)"; return 1
  fi
  "$venv/bin/python" -m ipykernel install --sys-prefix --name labkit >>"$log" 2>&1
  if ! (cd "$root" && "$venv/bin/python" -m pytest -p no:cacheprovider --basetemp="$work/pt-$ver" \
          -q -n 2 --dist loadgroup -m unit) >>"$log" 2>&1; then
    echo "Python $ver: unit tests FAILED (see $log)"; return 1
  fi
  echo "Python $ver: installed, unit tests $(grep -Eo '[0-9]+ passed[^=]*' "$log" | tail -1 | sed 's/ in .*//') in $(( $(date +%s) - start )) s with the install"
}

for py in "$@"; do
  check "$py" || failed=1
  rm -rf "$work"/venv-* "$work"/pt-*  # a venv with torch is 6 GB: one at a time
done
exit $failed
