
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
