// log-golden writes a fixed set of log records through Istio's own logger (istio.io/istio/pkg/log),
// configured from Istio's logging flags and with the scopes install-cni registers, and passes a
// batch of plugin records through install-cni's own log.sock server. Its output is the golden
// that crates/cni-agent/tests/agent/log_format.rs compares our logger with, record by record.
//
// tools/istio/build.sh builds it inside the pinned Istio module (an -overlay adds this file there),
// so Istio's go.mod and its exact dependency versions apply.
//
//	log-golden [ISTIO LOG FLAGS] PLUGIN_BATCH.json   # the records, to stdout
//	log-golden scopes                               # the scope names install-cni accepts
package main

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"

	"github.com/spf13/cobra"

	// Registers every scope install-cni's binary has, so `scopes` and the flags see the same set.
	_ "istio.io/istio/cni/pkg/cmd"
	"istio.io/istio/cni/pkg/constants"
	udslog "istio.io/istio/cni/pkg/log"
	"istio.io/istio/cni/pkg/scopes"
	"istio.io/istio/pkg/log"
)

func main() {
	opts := log.DefaultOptions()
	root := &cobra.Command{
		Use:          "log-golden PLUGIN_BATCH.json",
		Args:         cobra.ExactArgs(1),
		SilenceUsage: true,
		RunE: func(_ *cobra.Command, args []string) error {
			// As install-cni's PreRunE: a bad flag is logged, and the agent carries on.
			if err := log.Configure(opts); err != nil {
				scopes.CNIAgent.Errorf("Failed to configure log %v", err)
			}
			return emit(args[0])
		},
	}
	opts.AttachCobraFlags(root)
	root.AddCommand(&cobra.Command{
		Use:  "scopes",
		Args: cobra.NoArgs,
		Run: func(*cobra.Command, []string) {
			names := make([]string, 0)
			for name := range log.Scopes() {
				names = append(names, name)
			}
			sort.Strings(names)
			for _, n := range names {
				fmt.Println(n)
			}
		},
	})
	if err := root.Execute(); err != nil {
		os.Exit(1)
	}
}

// emit writes the records the Rust test writes too, in the same order.
func emit(pluginBatch string) error {
	agent := scopes.CNIAgent
	agent.Infof("installer configuration")
	agent.WithLabels("pod", "default/web-0").Debugf("checking pod")
	agent.WithLabels("pod", "default/web-0", "attempt", 2, "meshed", false).Warnf("pod not meshed yet")
	agent.Errorf("copying binaries: reading /opt/cni/bin: No such file or directory (os error 2)")
	log.WithLabels("component", "kube").Infof("default scope record")
	log.Debugf("default scope debug")

	body, err := os.ReadFile(pluginBatch)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "log-golden")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// Wired as install-cni wires it (cni/pkg/cmd/root.go): the cni-plugin scope gets cni-agent's level.
	sock := filepath.Join(dir, constants.LogUDSSocketName)
	stop := make(chan struct{})
	if err := udslog.NewUDSLogger(agent.GetOutputLevel()).StartUDSLogServer(sock, stop); err != nil {
		return err
	}
	client := http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	resp, err := client.Post("http://unix"+constants.UDSLogPath, "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	resp.Body.Close()
	agent.Infof("done")
	_ = log.Sync()
	return nil
}
