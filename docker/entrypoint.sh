#!/bin/sh
# Loads the CANN environment when the image was built on an Ascend base, then runs `glm5 <command>`.
set -eu
if [ "${GLM5_ACCELERATOR:-cpu}" = "ascend" ]; then
    for env in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
        # shellcheck disable=SC1090
        [ -f "$env" ] && . "$env"
    done
    export ASCEND_SLOG_PRINT_TO_STDOUT="${ASCEND_SLOG_PRINT_TO_STDOUT:-0}"
fi
exec glm5 "$@"
