#!/bin/sh
# The Compose stack's internal PKI (service `internal-pki`, run once before the components at every `up`).
# First start: creates the deployment's CA (its key stays on the volume only this service mounts) and one
# certificate per component instance; later starts issue only what is missing (more node certificates).
#   /pki/ca           ca.pem, ca.key                                 (this service only)
#   /pki/coordinator  ca.pem, cert.pem, key.pem   CN=openengine-coordinator, DNS coordinator.openengine-coordinator
#   /pki/frontend     ca.pem, cert.pem, key.pem   CN=openengine-frontend,    DNS frontend.openengine-frontend
#   /pki/node         ca.pem, node-<i>.pem/.key/.lock for i = 1..OPENENGINE_NODE_CERTS
#                     CN=openengine-node, DNS node-<i>.openengine-node: each node replica claims one (claim-node.sh)
# Every certificate also carries DNS openengine-internal, the name components check in their peers' certificates
# (OPENENGINE_INTERNAL_TLS_SERVER_NAME): a node's address is its container's hostname, unknown here.
set -eu
umask 077
NODES="${OPENENGINE_NODE_CERTS:-8}"
case "$NODES" in
  ''|*[!0-9]*) echo "internal-pki: OPENENGINE_NODE_CERTS must be a whole number from 1 to 256, not '$NODES'" >&2; exit 2 ;;
esac
if [ "$NODES" -lt 1 ] || [ "$NODES" -gt 256 ]; then
  echo "internal-pki: OPENENGINE_NODE_CERTS must be a whole number from 1 to 256, not '$NODES'" >&2; exit 2
fi
UID_GID=10001:10001  # the components' user (Dockerfile)
CA=/pki/ca
work=$(mktemp -d)

if [ ! -s "$CA/ca.key" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -keyout "$CA/ca.key.new" -out "$CA/ca.pem" -subj "/CN=openengine internal CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  mv "$CA/ca.key.new" "$CA/ca.key"
  echo "internal-pki: created the deployment's internal CA"
fi

# issue <directory> <role> <instance> <file stem>
issue() {
  dir=$1 role=$2 instance=$3 stem=$4
  cp "$CA/ca.pem" "$dir/ca.pem"
  if [ -s "$dir/$stem.pem" ] && openssl verify -CAfile "$CA/ca.pem" "$dir/$stem.pem" >/dev/null 2>&1; then
    return 0
  fi
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$work/key.pem" \
    -subj "/CN=openengine-$role" -out "$work/request.csr" 2>/dev/null
  printf '%s\n' "subjectAltName=DNS:$instance.openengine-$role,DNS:openengine-internal" \
    "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" > "$work/extensions"
  openssl x509 -req -in "$work/request.csr" -CA "$CA/ca.pem" -CAkey "$CA/ca.key" -days 825 \
    -set_serial "0x$(openssl rand -hex 16)" -extfile "$work/extensions" -out "$work/cert.pem" 2>/dev/null
  mv "$work/key.pem" "$dir/$stem.key"
  mv "$work/cert.pem" "$dir/$stem.pem"
  echo "internal-pki: issued $role instance $instance"
}

issue /pki/coordinator coordinator coordinator cert
issue /pki/frontend frontend frontend cert
i=1
while [ "$i" -le "$NODES" ]; do
  issue /pki/node node "node-$i" "node-$i"
  : > "/pki/node/node-$i.lock"
  i=$((i + 1))
done
# cert.key -> key.pem for the single-instance components
for dir in /pki/coordinator /pki/frontend; do
  [ -s "$dir/cert.key" ] && mv "$dir/cert.key" "$dir/key.pem"
done
chown -R "$UID_GID" /pki/coordinator /pki/frontend /pki/node
chmod 0444 /pki/coordinator/*.pem /pki/frontend/*.pem /pki/node/*.pem /pki/node/*.lock
chmod 0400 /pki/coordinator/key.pem /pki/frontend/key.pem /pki/node/*.key
rm -rf "$work"
