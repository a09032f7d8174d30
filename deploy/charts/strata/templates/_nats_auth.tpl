
{{/*
The NATS users and what each may publish and subscribe to (auth.conf): the chart's NATS includes
it, and with externalNats.url it is rendered on its own for that server to include. Passwords
are $VARIABLES the server reads from its environment (the auth Secret).
*/}}
{{- define "strata.nats.authConf" -}}
authorization {
  users = [
    {{- range include "strata.nats.users" . | fromJsonArray }}
    {{- if eq .role "services" }}
    # The services own the streams, the snapshot bucket and every event.
    {user: {{ .user | quote }}, password: ${{ .env }}, permissions: {
      publish: {allow: [">"]}
      subscribe: {allow: [">"]}
    }}
    {{- else if eq .role "gateway" }}
    # The gateway only reads: JetStream consumers and lookups, never a strata subject.
    {user: {{ .user | quote }}, password: ${{ .env }}, permissions: {
      publish: {
        allow: [
          "$JS.API.INFO", "$JS.API.STREAM.INFO.>", "$JS.API.STREAM.NAMES",
          "$JS.API.STREAM.LIST", "$JS.API.STREAM.MSG.GET.>", "$JS.API.DIRECT.GET.>",
          "$JS.API.CONSUMER.CREATE.>", "$JS.API.CONSUMER.INFO.>",
          "$JS.API.CONSUMER.DELETE.>", "$JS.FC.>"
        ]
        deny: ["strata.>"]
      }
      subscribe: {allow: ["strata.>", "_INBOX.>"]}
    }}
    {{- else }}
    {{- $job := .job }}
    {{- $worker := default "*" .worker }}
    {{- if eq .role "workers" }}
    # The workers of job {{ $job | quote }}, sharing this user: their heartbeats, samples and
    # requests, each on a subject that ends with the job and the sending worker. A shared
    # user confines them to the job, not to one worker: the worker part is a wildcard.
    {{- else }}
    # Worker {{ $worker | quote }} of job {{ $job | quote }} alone: its own heartbeats, samples
    # and requests, its own notices and replies.
    {{- end }}
    # Nothing on strata.evt: the services record every event themselves. The job's keys of
    # the torchrun rendezvous bucket (written on their subjects, read by direct gets naming
    # them), for torchrun --rdzv-backend=strata; no other JetStream API.
    {user: {{ .user | quote }}, password: ${{ .env }}, permissions: {
      publish: {
        allow: [
          {{- /* The bucket token is strata.events.subjects.heartbeat_bucket: SHA-256, two hex digits. */}}
          {{ printf "strata.hb.%s.%s.%s" (ternary "*" (sha256sum $worker | trunc 2) (eq $worker "*")) $job $worker | quote }},
          {{ printf "strata.metric.%s.%s.*" $job $worker | quote }},
          {{ printf "strata.rpc.*.*.%s.%s" $job $worker | quote }},
          {{- /* Answers to its own probes (strata.events.subjects.probe_answer_subject). */}}
          {{ printf "strata.probed.%s.%s.*" $job $worker | quote }},
          {{- /* The same requests where the server's mapping moves them (it checks permissions after). */}}
          {{ printf "strata.rpcp.%s.*.*.%s.%s" (include "strata.rpcPartition" (list $job $.Values.coordinator.admission.partitions)) $job $worker | quote }},
          {{ printf "$KV.STRATA_RENDEZVOUS.%s.>" $job | quote }},
          {{- /* Each job's keys are in a stream of its own (strata.events.subjects.rendezvous_stream_name). */}}
          {{ printf "$JS.API.DIRECT.GET.KV_STRATA_RENDEZVOUS_%s.$KV.STRATA_RENDEZVOUS.%s.>" $job $job | quote }}
        ]
        deny: [
          "strata.ctl.>", "$KV.STRATA_SNAPSHOTS.>", "$JS.API.STREAM.>", "$JS.API.CONSUMER.>",
          "$JS.API.ACCOUNT.>", "$JS.API.META.>", "$JS.API.SERVER.>"
        ]
      }
      subscribe: {
        allow: [
          {{ printf "strata.evt.%s.barrier.*" $job | quote }},
          {{ printf "strata.evt.%s.shard.plan_changed" $job | quote }},
          {{ printf "strata.world.%s" $job | quote }},
          {{ printf "strata.ctl.%s.%s" $job $worker | quote }},
          {{ printf "strata.probe.%s.%s.*" $job $worker | quote }},
          {{ printf "_INBOX_strata.%s.%s.>" $job $worker | quote }},
          {{ printf "$KV.STRATA_RENDEZVOUS.%s.>" $job | quote }}
        ]
      }
    }}
    {{- end }}
    {{- end }}
  ]
}
{{- end }}

{{/*
The request partition of a job (list job partitions): the FNV-1a hash of the job's subject token
(`.` written `~`) modulo the partitions, as nats-server's partition() subject transform computes
it (strata.events.subjects.rpc_partition_of; a test compares them). Templates have no XOR: the
low byte's is taken bit by bit.
*/}}
{{- define "strata.rpcPartition" -}}
{{- $token := replace "." "~" (index . 0) }}
{{- $partitions := int64 (index . 1) }}
{{- $codes := "-0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_abcdefghijklmnopqrstuvwxyz~" }}
{{- $first := list 45 48 49 50 51 52 53 54 55 56 57 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 95 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119 120 121 122 126 }}
{{- $hash := int64 2166136261 }}
{{- range $char := splitList "" $token }}
{{- $byte := 0 }}
{{- range $at, $code := $first }}
{{- if eq (substr $at (add1 $at | int) $codes) $char }}{{ $byte = $code }}{{ end }}
{{- end }}
{{- $low := mod $hash 256 }}
{{- $mixed := 0 }}
{{- range $weight := list 1 2 4 8 16 32 64 128 }}
{{- $mixed = add $mixed (mul $weight (mod (add (mod (div $low $weight) 2) (mod (div $byte $weight) 2)) 2)) }}
{{- end }}
{{- $hash = mod (mul (add (sub $hash $low) $mixed) 16777619) 4294967296 }}
{{- end }}
{{- mod $hash $partitions }}
{{- end }}

{{/*
The subject mapping that moves every worker's request to its job's partition
(strata.events.subjects.rpc_partition_mapping; a test compares them).
*/}}
{{- define "strata.nats.mappings" -}}
{{- $partitions := int64 .Values.coordinator.admission.partitions -}}
mappings {
  "strata.rpc.*.*.*.*": {{ printf "strata.rpcp.{{partition(%d,3)}}.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}.{{wildcard(4)}}" $partitions | quote }}
}
{{- end }}
