# Clade on Nomad: a system job, one `clade serve --cluster` node on every client that
# has KVM (node.class "kvm"). PostgreSQL and the object store bucket are external; their
# URLs and credentials come from Nomad variables at nomad/jobs/clade (see
# deploy/README.md). Put any load balancer in front of the nodes' port 3000: every node
# answers every E2B request.
job "clade" {
  type        = "system"
  datacenters = ["*"]

  constraint {
    attribute = "${node.class}"
    value     = "kvm"
  }

  update {
    max_parallel = 1
    stagger      = "30s"
  }

  group "node" {
    network {
      mode = "host"
      port "api" {
        static = 3000
      }
    }

    service {
      name     = "clade"
      port     = "api"
      provider = "nomad"
      check {
        type     = "tcp"
        interval = "5s"
        timeout  = "2s"
      }
    }

    task "clade" {
      # /dev/kvm, network namespaces, nftables and cgroups of the host.
      driver = "raw_exec"

      config {
        command = "/usr/local/bin/clade"
        args = [
          "serve",
          "--listen", "${NOMAD_IP_api}:3000",
          "--advertise", "http://${NOMAD_IP_api}:3000",
          # Hops in clear text (they carry the cluster secret): for TLS give an https://
          # --advertise, --tls-cert/--tls-key and --cluster-ca instead (docs/cluster.md).
          "--cluster-plain-http",
          "--node-name", "${node.unique.name}",
          "--state-dir", "/var/lib/clade",
        ]
      }

      # A drain moves running sandboxes to other nodes before the task stops.
      kill_timeout = "600s"
      kill_signal  = "SIGTERM"

      template {
        destination = "secrets/clade.env"
        env         = true
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/clade" }}
          CLADE_CLUSTER={{ .postgres_url }}
          CLADE_CLUSTER_SECRET={{ .cluster_secret }}
          CLADE_API_KEY={{ .api_key }}
          CLADE_STORE={{ .store_url }}
          AWS_ACCESS_KEY_ID={{ .aws_access_key_id }}
          AWS_SECRET_ACCESS_KEY={{ .aws_secret_access_key }}
          AWS_REGION={{ .aws_region }}
          {{ end }}
        EOT
      }

      resources {
        cpu    = 1000
        memory = 1024
      }
    }
  }
}
