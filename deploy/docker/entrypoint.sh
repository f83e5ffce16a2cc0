#!/bin/sh
# Image entrypoint: read tokens from secret files, then run `specroll`.
#   SPECROLL_ADMIN_TOKEN_FILE / SPECROLL_API_TOKEN_FILE: a file holding the token (Docker/Kubernetes secret);
#   it sets SPECROLL_ADMIN_TOKEN / SPECROLL_API_TOKEN, so a token never appears on a command line.
# With no arguments, or options only, it serves (`specroll serve ...`); otherwise the first argument is the
# subcommand (`drafter-trainer ...`, `generate ...`).
set -eu
for name in SPECROLL_ADMIN_TOKEN SPECROLL_API_TOKEN; do
    file=$(printenv "${name}_FILE" || true)
    if [ -n "$file" ]; then
        if [ ! -r "$file" ]; then
            echo "specroll-entrypoint: ${name}_FILE=$file is not a readable file" >&2
            exit 2
        fi
        value=$(cat "$file")
        export "$name=$value"
        unset "${name}_FILE"
    fi
done
case "${1:-}" in
    "" | -*) exec specroll serve "$@" ;;
    *) exec specroll "$@" ;;
esac
