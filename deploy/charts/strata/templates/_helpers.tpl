{{/*
Names, labels and the pieces every Strata pod shares (image, environment, security, volumes).
*/}}

{{- define "strata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name; resources are named "<fullname>-<part>", so it leaves room for the
longest part ("-nats-headless") within the 63 characters of a DNS label.
*/}}
{{- define "strata.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "strata.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: include "strata.selectorLabels" (list $ "registry") */}}
{{- define "strata.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "strata.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Every label of one component: include "strata.labels" (list $ "registry") */}}
{{- define "strata.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "strata.chart" $root }}
{{ include "strata.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: strata
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end }}

{{- define "strata.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "strata.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "strata.image" -}}
{{- $image := .Values.coordinator.image -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}

{{/*
The workers' image: workers.image when set; otherwise the example image, the coordinator image's
repository with "-example" after its tag (deploy/docker/Dockerfile, target example: CPU PyTorch).
*/}}
{{- define "strata.workerImage" -}}
{{- $image := include "strata.workerImageValues" . | fromJson -}}
{{- if $image.repository }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- else }}
{{- $coordinator := .Values.coordinator.image -}}
{{- printf "%s:%s" $coordinator.repository (default (printf "%s-example" (default .Chart.AppVersion $coordinator.tag)) $image.tag) }}
{{- end }}
{{- end }}

{{/*
workers.image as {repository, tag, pullPolicy}: the seeds' values give it as one string,
"repository[:tag]" (a colon after the last slash starts the tag).
*/}}
{{- define "strata.workerImageValues" -}}
{{- $image := .Values.workers.image -}}
{{- if kindIs "string" $image }}
{{- $last := last (splitList "/" $image) }}
{{- $tag := "" }}
{{- $repository := $image }}
{{- if contains ":" $last }}
{{- $tag = last (splitList ":" $last) }}
{{- $repository = trimSuffix (printf ":%s" $tag) $image }}
{{- end }}
{{- toJson (dict "repository" $repository "tag" $tag "pullPolicy" "IfNotPresent") }}
{{- else }}
{{- toJson $image }}
{{- end }}
{{- end }}

{{/* True (non-empty) when the chart runs its own NATS. */}}
{{- define "strata.nats.internal" -}}
{{- if not .Values.externalNats.url }}true{{ end }}
{{- end }}

{{- define "strata.nats.url" -}}
{{- if .Values.externalNats.url }}
{{- .Values.externalNats.url }}
{{- else }}
{{- printf "nats://%s-nats.%s.svc:4222" (include "strata.fullname" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
JetStream replicas of Strata's streams: 3 when the chart's NATS has a quorum to give them, 1 for a
single server; for an external NATS the operator says.
*/}}
{{- define "strata.streamReplicas" -}}
{{- if .Values.externalNats.url }}
{{- .Values.externalNats.streamReplicas }}
{{- else if ge (int .Values.nats.replicas) 3 }}3
{{- else }}1
{{- end }}
{{- end }}

{{- define "strata.nats.authSecret" -}}
{{- default (printf "%s-nats-auth" (include "strata.fullname" .)) .Values.nats.auth.existingSecret }}
{{- end }}

{{/* Every job that gets a NATS worker user: workers.job first, then the extra ones. */}}
{{- define "strata.workerJobs" -}}
{{- $jobs := list .Values.workers.job }}
{{- range .Values.nats.auth.extraWorkerJobs }}
{{- if not (has . $jobs) }}{{ $jobs = append $jobs . }}{{ end }}
{{- end }}
{{- toJson $jobs }}
{{- end }}

{{/* Every job with a worker user: the services make each one's rendezvous bucket. */}}
{{- define "strata.rendezvousJobs" -}}
{{- $jobs := include "strata.workerJobs" . | fromJsonArray }}
{{- range .Values.nats.auth.workerUsers }}
{{- if not (has .job $jobs) }}{{ $jobs = append $jobs .job }}{{ end }}
{{- end }}
{{- join "," $jobs }}
{{- end }}

{{/*
NATS user names. A workers user is shared by the workers of one job; its name has no "@", so the
SDK does not take it for one worker's (per-worker user names are <worker>@<job>).
*/}}
{{- define "strata.nats.workerUser" -}}
{{- printf "strata-workers-%s" . }}
{{- end }}

{{/* The environment NATS credentials: include "strata.natsCredentialsEnv" (list $ "services") */}}
{{- define "strata.natsCredentialsEnv" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- if $root.Values.nats.auth.enabled }}
{{- $user := printf "strata-%s" $role }}
{{- $key := printf "%s-password" $role }}
{{- if hasPrefix "workers-" $role }}
{{- $user = include "strata.nats.workerUser" (trimPrefix "workers-" $role) }}
{{- end }}
- name: STRATA_NATS_USER
  value: {{ $user | quote }}
- name: STRATA_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "strata.nats.authSecret" $root }}
      key: {{ $key }}
{{- end }}
{{- end }}

{{/* Settings every Strata process reads: NATS, heartbeats, logs. */}}
{{- define "strata.commonEnv" -}}
- name: STRATA_NATS_URL
  value: {{ include "strata.nats.url" . | quote }}
- name: STRATA_STREAM_REPLICAS
  value: {{ include "strata.streamReplicas" . | quote }}
- name: STRATA_HEARTBEAT_INTERVAL
  value: {{ .Values.coordinator.heartbeatInterval | toString | quote }}
- name: STRATA_HEARTBEAT_TIMEOUT
  value: {{ .Values.coordinator.heartbeatTimeout | toString | quote }}
- name: STRATA_LOG_FORMAT
  value: {{ .Values.coordinator.logFormat | quote }}
- name: STRATA_LOG_LEVEL
  value: {{ .Values.coordinator.logLevel | quote }}
- name: STRATA_DATA_DIR
  value: /tmp/strata
{{- end }}

{{/*
Where checkpoints go: only for the pods that read or write them (checkpoint service, workers), so
the storage credentials reach no other pod. Called with (list $ secret): the checkpoint service
gets storage.s3.existingSecret, the workers workers.storageSecret when set (credentials for their
job's own prefix only, docs/storage.md), else the same.
*/}}
{{- define "strata.storageEnv" -}}
{{- $root := index . 0 -}}
{{- $secret := index . 1 -}}
- name: STORAGE_BACKEND
  value: {{ $root.Values.storage.backend | quote }}
{{- if eq $root.Values.storage.backend "s3" }}
- name: CHECKPOINT_BUCKET
  value: {{ $root.Values.storage.s3.bucket | quote }}
{{- with $root.Values.storage.s3.region }}
- name: AWS_REGION
  value: {{ . | quote }}
{{- end }}
{{- with $root.Values.storage.s3.endpoint }}
- name: STRATA_S3_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with $secret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_ACCESS_KEY_ID
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: AWS_SECRET_ACCESS_KEY
{{- end }}
{{- end }}
{{- end }}

{{/* True (non-empty) when checkpoints go to the shared volume. */}}
{{- define "strata.checkpoints.local" -}}
{{- if eq .Values.storage.backend "local" }}true{{ end }}
{{- end }}

{{- define "strata.checkpoints.claim" -}}
{{- default (printf "%s-checkpoints" (include "strata.fullname" .)) .Values.persistence.existingClaim }}
{{- end }}

{{/*
The checkpoints volume for pods that read or write checkpoints. Without persistence it is an
emptyDir: good for a look around, useless for recovery (NOTES.txt says so).
*/}}
{{- define "strata.checkpoints.volume" -}}
{{- if include "strata.checkpoints.local" . }}
- name: checkpoints
{{- if .Values.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "strata.checkpoints.claim" . }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- end }}

{{- define "strata.checkpoints.mount" -}}
{{- if include "strata.checkpoints.local" . }}
- name: checkpoints
  mountPath: /data/checkpoints
{{- end }}
{{- end }}

{{- define "strata.probe" -}}
{{- $path := index . 0 -}}
{{- $port := index . 1 -}}
httpGet:
  path: {{ $path }}
  port: {{ $port }}
{{- if eq $path "/healthz" }}
initialDelaySeconds: 5
periodSeconds: 10
timeoutSeconds: 3
failureThreshold: 6
{{- else }}
periodSeconds: 5
timeoutSeconds: 3
failureThreshold: 3
{{- end }}
{{- end }}

{{/*
The NATS users, as JSON: user name, role, job (workers only), worker (per-worker users only), the
key of its password in the auth Secret and the environment variable the NATS server reads it from.
A "workers" user is shared by every worker of its job; a "worker" user (nats.auth.workerUsers)
is one worker's, named <worker>@<job> as `strata up --secure` names them, so the SDK takes its
job and worker id from it.
*/}}
{{- define "strata.nats.users" -}}
{{- $users := list
  (dict "user" "strata-services" "role" "services" "key" "services-password" "env" "STRATA_SERVICES_PASSWORD")
  (dict "user" "strata-gateway" "role" "gateway" "key" "gateway-password" "env" "STRATA_GATEWAY_PASSWORD") }}
{{- range $index, $job := include "strata.workerJobs" . | fromJsonArray }}
{{- $users = append $users (dict
  "user" (include "strata.nats.workerUser" $job)
  "role" "workers"
  "job" $job
  "key" (printf "workers-%s-password" $job)
  "env" (printf "STRATA_WORKERS_%d_PASSWORD" $index)) }}
{{- end }}
{{- range $index, $each := .Values.nats.auth.workerUsers }}
{{- $users = append $users (dict
  "user" (printf "%s@%s" $each.worker $each.job)
  "role" "worker"
  "job" $each.job
  "worker" $each.worker
  "key" (printf "worker-%s-%s-password" $each.job $each.worker)
  "env" (printf "STRATA_WORKER_%d_PASSWORD" $index)) }}
{{- end }}
{{- toJson $users }}
{{- end }}

{{/*
True (non-empty) when the NATS replicas authenticate each other's routes: the chart runs a
cluster of its own and nats.routeAuth.enabled.
*/}}
{{- define "strata.nats.routeAuth" -}}
{{- if and (include "strata.nats.internal" .) (gt (int .Values.nats.replicas) 1) .Values.nats.routeAuth.enabled }}true{{ end }}
{{- end }}

{{- define "strata.nats.routesSecret" -}}
{{- default (printf "%s-nats-routes" (include "strata.fullname" .)) .Values.nats.routeAuth.existingSecret }}
{{- end }}

{{/* The user NATS replicas present to each other on their routes. */}}
{{- define "strata.nats.routeUser" -}}strata-route{{- end }}

{{/* host:port of each replica's route listener, as JSON. */}}
{{- define "strata.nats.routeHosts" -}}
{{- $fullname := include "strata.fullname" . }}
{{- $hosts := list }}
{{- range $i := until (int .Values.nats.replicas) }}
{{- $hosts = append $hosts (printf "%s-nats-%d.%s-nats-headless.%s.svc.%s:6222" $fullname $i $fullname $.Release.Namespace $.Values.nats.clusterDomain) }}
{{- end }}
{{- toJson $hosts }}
{{- end }}

{{/* True (non-empty) when the gateway asks for an API token. */}}
{{- define "strata.apiToken" -}}
{{- if .Values.coordinator.apiToken.enabled }}true{{ end }}
{{- end }}

{{- define "strata.apiTokenSecret" -}}
{{- default (printf "%s-api-token" (include "strata.fullname" .)) .Values.coordinator.apiToken.existingSecret }}
{{- end }}

{{/*
The Strata service components, one Deployment each: every service once, and the registry once
more per extra heartbeat partition (registry-1, registry-2, ...; `registry` is partition 0).
*/}}
{{- define "strata.components" -}}
{{- $names := list "registry" }}
{{- range $partition := until (int .Values.coordinator.services.registry.partitions) }}
{{- if $partition }}
{{- $names = append $names (printf "registry-%d" $partition) }}
{{- end }}
{{- end }}
{{- toJson (concat $names (list "sharding" "barrier" "checkpoint" "gateway")) }}
{{- end }}

{{/* The Strata pods' components: the NATS client port is theirs alone. */}}
{{- define "strata.clientComponents" -}}
{{- toJson (concat (include "strata.components" . | fromJsonArray) (list "worker" "test")) }}
{{- end }}

{{/*
Where the workers keep their checkpoints (STRATA_CHECKPOINTS): the shared volume's mount, or the
bucket's checkpoints/ prefix. The SDK puts each job in a directory of its own below it.
*/}}
{{- define "strata.checkpoints.uri" -}}
{{- if eq .Values.storage.backend "s3" }}
{{- printf "s3://%s/checkpoints" .Values.storage.s3.bucket }}
{{- else }}
{{- print "/data/checkpoints" }}
{{- end }}
{{- end }}

{{/* The demo job's arguments: the chart's settings through $(VAR), the sizes from values. */}}
{{- define "strata.demoArgs" -}}
{{- $demo := .Values.workers.demo -}}
- --job=$(STRATA_JOB)
- --nats-url=$(STRATA_NATS_URL)
- --checkpoints=$(STRATA_CHECKPOINTS)
- --world-size=$(STRATA_WORLD_SIZE)
- {{ printf "--epochs=%d" (int $demo.epochs) | quote }}
- {{ printf "--samples=%d" (int $demo.samples) | quote }}
- {{ printf "--shard-size=%d" (int $demo.shardSize) | quote }}
- {{ printf "--batch-size=%d" (int $demo.batchSize) | quote }}
- {{ printf "--round-batches=%d" (int $demo.roundBatches) | quote }}
- {{ printf "--barrier-timeout=%v" $demo.barrierTimeout | quote }}
- {{ printf "--keep-count=%d" (int $demo.keepCount) | quote }}
{{- if eq .Values.workers.kind "Job" }}
{{- $svc := include "strata.workerService" . }}
- {{ printf "--pg-master=%s-0.%s.%s.svc:%d" (include "strata.workerName" .) $svc .Release.Namespace (int $demo.pgPort) | quote }}
{{- end }}
{{- end }}

{{/* The workers' Job or Deployment. */}}
{{- define "strata.workerName" -}}
{{ include "strata.fullname" . }}-worker
{{- end }}

{{/* The headless Service that names the Indexed Job's pods: <job>-<index>.<service>. */}}
{{- define "strata.workerService" -}}
{{ include "strata.fullname" . }}-worker
{{- end }}
