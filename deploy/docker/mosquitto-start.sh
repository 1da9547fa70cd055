#!/bin/sh
# Start mosquitto with the shipped config (deploy/mosquitto, mounted at /edgepack/mosquitto):
# its password file is made here, at every start, from EDGEPACK_MQTT_ACCOUNTS ("USER:FILE ...",
# each FILE holding that account's password: docker secrets), so no password is baked into an
# image or a volume. Runs as root (eclipse-mosquitto:2 or Debian's mosquitto); mosquitto itself
# drops to its `mosquitto` user.
set -eu
conf_dir=/etc/mosquitto/edgepack
mkdir -p "$conf_dir" /var/lib/mosquitto
umask 077
: > "$conf_dir/passwd"
for account in ${EDGEPACK_MQTT_ACCOUNTS:?EDGEPACK_MQTT_ACCOUNTS is empty}; do
  user=${account%%:*}
  file=${account#*:}
  [ -r "$file" ] || { echo "mosquitto-start: cannot read the password of $user ($file)" >&2; exit 1; }
  mosquitto_passwd -b "$conf_dir/passwd" "$user" "$(cat "$file")"
done
cp /edgepack/mosquitto/acl "$conf_dir/acl"
cp /edgepack/mosquitto/mosquitto.conf "$conf_dir/mosquitto.conf"
chown -R mosquitto:mosquitto "$conf_dir" /var/lib/mosquitto
exec mosquitto -c "$conf_dir/mosquitto.conf"
