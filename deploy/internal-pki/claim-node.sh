#!/bin/sh
# A node replica's entrypoint in Compose: claims one free node certificate (an exclusive lock on its .lock file,
# held by the node process for its lifetime and released by the kernel when it ends, however it ends), copies it
# where OPENENGINE_INTERNAL_TLS_* point, and runs the node as the instance the certificate names.
set -eu
SOURCE=/etc/openengine/internal-pki
TARGET=$(dirname "$OPENENGINE_INTERNAL_TLS_CERT_FILE")
for cert in "$SOURCE"/node-*.pem; do
  [ -e "$cert" ] || break
  id=$(basename "$cert" .pem)
  exec 9<"$SOURCE/$id.lock"
  if flock -n 9; then
    mkdir -p "$TARGET"
    # A restarted container finds its last copies (read-only): replace them.
    rm -f "$OPENENGINE_INTERNAL_TLS_CERT_FILE" "$OPENENGINE_INTERNAL_TLS_KEY_FILE" "$OPENENGINE_INTERNAL_TLS_CA_FILE"
    (umask 077 && cp "$cert" "$OPENENGINE_INTERNAL_TLS_CERT_FILE" && cp "$SOURCE/$id.key" "$OPENENGINE_INTERNAL_TLS_KEY_FILE")
    cp "$SOURCE/ca.pem" "$OPENENGINE_INTERNAL_TLS_CA_FILE"
    export OPENENGINE_NODE_ID="$id"
    exec openengine-serve node "$@"
  fi
  exec 9<&-
done
echo "node: no free node certificate in $SOURCE: every one is held by another node replica (or internal-pki has" \
  "not run). Raise OPENENGINE_NODE_CERTS to at least the number of node replicas and run docker compose up again." >&2
exit 2
