#!/bin/sh
# Entry point of the KCaaS image. Secrets may come as files (Docker secrets, or the bootstrap service's shared
# volume): for each NAME below, NAME_FILE set and NAME unset => NAME is exported with the file's content. Then the
# service's command runs in place of this shell (exec: it receives the container's signals directly).
set -eu
for name in KCAAS_NODE_CREDENTIAL SECRET_KEY KCAAS_KEY_PEPPER KCAAS_KEK KCAAS_TOKEN_SIGNING_KEY_PEM; do
    eval "file=\${${name}_FILE:-}"
    eval "value=\${${name}:-}"
    if [ -n "$file" ] && [ -z "$value" ]; then
        if [ ! -r "$file" ]; then
            echo "container-entrypoint: ${name}_FILE=$file is not readable" >&2
            exit 1
        fi
        export "$name=$(cat "$file")"
    fi
done
exec "$@"
