#!/bin/sh
# Serve's HAProxy as hetero-exec's embedded default starts it (actors/connect.py
# serve_ingress_env points RAY_SERVE_HAPROXY_BINARY_PATH here). Serve's template binds
# the stats and metrics listeners to every interface (`bind :PORT`, `bind *:PORT`) and
# answers a replica it could not reach with a text/plain page; before each start (and
# reload) this rewrites the configuration it is given with -f: those listeners on
# 127.0.0.1, and HAProxy's own 502/503/504 as the JSON error body the app answers
# with. The frontend keeps the host Serve was given (`--host`). Its defaults also wait for
# a request's whole body before picking a replica (`option http-buffer-request`): HAProxy
# retries (retry-on, actors/connect.py) only a request it holds whole, and one whose body
# came a read after its headers was sent on unbuffered, so a replica killed under it left
# the client a 502 with no retry (`SH--`, retries 0 in HAProxy's log).
here=$(dirname "$0")
cfg=""
prev=""
for arg in "$@"; do
    [ "$prev" = "-f" ] && cfg=$arg
    prev=$arg
done
if [ -n "$cfg" ] && [ -w "$cfg" ]; then
    sed -i -e 's/^\([[:space:]]*bind[[:space:]]\{1,\}\)\*\{0,1\}:\([0-9]\{1,\}\)/\1127.0.0.1:\2/' \
        -e "s#^\([[:space:]]*errorfile[[:space:]]\{1,\}50[234][[:space:]]\{1,\}\).*#\1$here/haproxy_error.http#" \
        "$cfg"
    grep -q '^[[:space:]]*option[[:space:]]\{1,\}http-buffer-request' "$cfg" ||
        sed -i 's/^defaults[[:space:]]*$/defaults\n    option http-buffer-request/' "$cfg"
fi
exec "$HETERO_EXEC_HAPROXY_BINARY" "$@"
