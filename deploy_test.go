package main

// The Kubernetes manifests under deploy/ are built with kustomize, decoded
// strictly into their k8s.io/api types and checked against each other and
// against kvroute's real flags, so that `kubectl apply -k` of any of them
// yields a rollout that works: every Service selects pods of the same
// build on ports they declare, kvroute's arguments are flags it parses and
// accepts, its pool Services exist, its termination grace period covers
// --shutdown-delay + --drain-timeout, and its pods run as the restricted
// Pod Security Standard asks.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/kustomize/api/krusty"
	kusttypes "sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/kvroute/kvroute/app"
	"github.com/kvroute/kvroute/proxy"
)

const (
	deployDir       = "deploy"
	deployNamespace = "llm"
	// kvrouteContainer names the router's container in a pod template.
	kvrouteContainer = "kvroute"
	// vllmImage prefixes the image of the example vLLM pods.
	vllmImage = "vllm/vllm-openai"
)

// deployClientService is the Service clients use in each kustomization
// (relative to deploy/): "vllm", the name of the ClusterIP Service kvroute
// replaces, except where kvroute runs beside the old Service.
var deployClientService = map[string]string{"overlays/migrate": "kvroute"}

// deployExternalPods lists, per kustomization, the Services that select
// pods the build does not contain (the vLLM pods an operator already runs).
var deployExternalPods = map[string][]string{"overlays/migrate": {"vllm-pods"}}

// deployKinds are the kinds the manifests may hold, each decoded into its
// k8s.io/api type; any other kind fails.
var deployKinds = map[string]func() any{
	"apps/v1/Deployment":            func() any { return new(appsv1.Deployment) },
	"apps/v1/StatefulSet":           func() any { return new(appsv1.StatefulSet) },
	"v1/Service":                    func() any { return new(corev1.Service) },
	"v1/Secret":                     func() any { return new(corev1.Secret) },
	"v1/ConfigMap":                  func() any { return new(corev1.ConfigMap) },
	"v1/ServiceAccount":             func() any { return new(corev1.ServiceAccount) },
	"v1/Namespace":                  func() any { return new(corev1.Namespace) },
	"v1/PersistentVolumeClaim":      func() any { return new(corev1.PersistentVolumeClaim) },
	"policy/v1/PodDisruptionBudget": func() any { return new(policyv1.PodDisruptionBudget) },
}

// deployObject is one decoded manifest document.
type deployObject struct {
	Kind, Name, Namespace string
	Obj                   any
}

// deployWorkload is a Deployment or StatefulSet: what a Service selects.
type deployWorkload struct {
	Kind, Name, Namespace string
	Replicas              int32
	Selector              *metav1.LabelSelector
	Template              *corev1.PodTemplateSpec
}

func (w deployWorkload) String() string { return w.Kind + "/" + w.Name }

// deployBuild is the decoded output of one kustomization.
type deployBuild struct {
	Dir       string // relative to deploy/
	Objects   []deployObject
	Workloads []deployWorkload
	Services  []*corev1.Service
	Secrets   []*corev1.Secret
	Maps      []*corev1.ConfigMap
	PDBs      []*policyv1.PodDisruptionBudget
	SAs       []*corev1.ServiceAccount
}

// deployDecode decodes one YAML document strictly into the k8s.io/api type
// of its kind: an unknown field, a duplicate key, a wrong type or an
// unknown kind is an error. A document of comments only decodes to nil.
func deployDecode(doc []byte) (*deployObject, error) {
	js, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return nil, err
	}
	if s := strings.TrimSpace(string(js)); s == "null" || s == "" {
		return nil, nil
	}
	var tm metav1.TypeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return nil, fmt.Errorf("not an object: %v", err)
	}
	newObj, ok := deployKinds[tm.APIVersion+"/"+tm.Kind]
	if !ok {
		return nil, fmt.Errorf("unknown kind %q (apiVersion %q): add its k8s.io/api type to deployKinds", tm.Kind, tm.APIVersion)
	}
	// Decoded as the API server decodes JSON: unknown fields are errors, and
	// so is a YAML number where a string belongs (sigs.k8s.io/yaml's own
	// Unmarshal would quietly convert it; kubectl apply would not).
	if err := yaml.UnmarshalStrict(doc, newObj()); err != nil { // duplicate keys
		return nil, fmt.Errorf("%s: %v", tm.Kind, err)
	}
	obj := newObj()
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(obj); err != nil {
		return nil, fmt.Errorf("%s: %v", tm.Kind, err)
	}
	meta, ok := obj.(metav1.Object)
	if !ok {
		return nil, fmt.Errorf("%s has no object metadata", tm.Kind)
	}
	if meta.GetName() == "" {
		return nil, fmt.Errorf("%s without metadata.name", tm.Kind)
	}
	return &deployObject{Kind: tm.Kind, Name: meta.GetName(), Namespace: meta.GetNamespace(), Obj: obj}, nil
}

var deployDocSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// deployDecodeAll decodes every document of a multi-document YAML stream.
func deployDecodeAll(data []byte) ([]deployObject, error) {
	var out []deployObject
	for i, doc := range deployDocSep.Split(string(data), -1) {
		o, err := deployDecode([]byte(doc))
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i+1, err)
		}
		if o != nil {
			out = append(out, *o)
		}
	}
	return out, nil
}

// deployKustomizations returns the kustomization directories under
// deploy/ (relative to deploy/) and those another kustomization uses as a
// resource (bases, not applied alone).
func deployKustomizations(t *testing.T) (dirs []string, bases map[string]bool) {
	t.Helper()
	bases = map[string]bool{}
	err := filepath.WalkDir(deployDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !slices.Contains([]string{"kustomization.yaml", "kustomization.yml", "Kustomization"}, d.Name()) {
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		var k kusttypes.Kustomization
		if err := yaml.UnmarshalStrict(data, &k); err != nil {
			t.Errorf("%s: not a valid kustomization (strict): %v", path, err)
			return nil
		}
		dir := filepath.Dir(path)
		rel, _ := filepath.Rel(deployDir, dir)
		dirs = append(dirs, filepath.ToSlash(rel))
		for _, r := range append(k.Resources, k.Components...) {
			p := filepath.Join(dir, r)
			if fi, err := os.Stat(p); err == nil && fi.IsDir() {
				b, _ := filepath.Rel(deployDir, p)
				bases[filepath.ToSlash(b)] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(dirs)
	return dirs, bases
}

// deployRun builds the kustomization in deploy/<dir> and decodes it.
func deployRun(t *testing.T, dir string) *deployBuild {
	t.Helper()
	abs, err := filepath.Abs(filepath.Join(deployDir, dir))
	if err != nil {
		t.Fatal(err)
	}
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), abs)
	if err != nil {
		t.Fatalf("kustomize build deploy/%s: %v", dir, err)
	}
	b := &deployBuild{Dir: dir}
	for _, r := range m.Resources() {
		y, err := r.AsYAML()
		if err != nil {
			t.Fatalf("deploy/%s: %s: %v", dir, r.CurId(), err)
		}
		o, err := deployDecode(y)
		if err != nil {
			t.Errorf("deploy/%s: %s: %v", dir, r.CurId(), err)
			continue
		}
		if o == nil {
			continue
		}
		b.Objects = append(b.Objects, *o)
		switch v := o.Obj.(type) {
		case *appsv1.Deployment:
			b.Workloads = append(b.Workloads, deployWorkload{"Deployment", v.Name, v.Namespace, deployReplicas(v.Spec.Replicas), v.Spec.Selector, &v.Spec.Template})
		case *appsv1.StatefulSet:
			b.Workloads = append(b.Workloads, deployWorkload{"StatefulSet", v.Name, v.Namespace, deployReplicas(v.Spec.Replicas), v.Spec.Selector, &v.Spec.Template})
		case *corev1.Service:
			b.Services = append(b.Services, v)
		case *corev1.Secret:
			b.Secrets = append(b.Secrets, v)
		case *corev1.ConfigMap:
			b.Maps = append(b.Maps, v)
		case *policyv1.PodDisruptionBudget:
			b.PDBs = append(b.PDBs, v)
		case *corev1.ServiceAccount:
			b.SAs = append(b.SAs, v)
		}
	}
	if len(b.Objects) == 0 {
		t.Fatalf("deploy/%s builds to nothing", dir)
	}
	return b
}

func deployReplicas(r *int32) int32 {
	if r == nil {
		return 1 // the API's default
	}
	return *r
}

// deployRawSecrets decodes every YAML file under deploy/ but the
// kustomizations strictly, and returns the Secrets they hold (the admin
// token's example among them).
func deployRawSecrets(t *testing.T) []*corev1.Secret {
	t.Helper()
	var secrets []*corev1.Secret
	n := 0
	err := filepath.WalkDir(deployDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		ext := filepath.Ext(path)
		if d.IsDir() || (ext != ".yaml" && ext != ".yml") || strings.HasPrefix(d.Name(), "kustomization.") {
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		objs, err := deployDecodeAll(data)
		if err != nil {
			t.Errorf("%s: %v", path, err)
			return nil
		}
		if len(objs) == 0 {
			t.Errorf("%s: no Kubernetes object in it", path)
		}
		n++
		for _, o := range objs {
			if s, ok := o.Obj.(*corev1.Secret); ok {
				secrets = append(secrets, s)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("no YAML manifests under deploy/")
	}
	return secrets
}

// TestDeployStrictDecodingRejects makes sure the strict decoding this file
// relies on does reject what it should.
func TestDeployStrictDecodingRejects(t *testing.T) {
	for name, doc := range map[string]string{
		"unknown field":   "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {selectr: {app: a}}\n",
		"unknown kind":    "apiVersion: v1\nkind: Servise\nmetadata: {name: a}\n",
		"wrong type":      "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\nspec: {replicas: two}\n",
		"env value int":   "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\nspec: {template: {spec: {containers: [{name: a, env: [{name: P, value: 5600}]}]}}}\n",
		"unlisted kind":   "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n",
		"duplicate key":   "apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {type: ClusterIP, type: None}\n",
		"nested unknown":  "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\nspec: {template: {spec: {containers: [{name: a, imagePullPolicy: Always, argz: []}]}}}\n",
		"no name":         "apiVersion: v1\nkind: Service\nmetadata: {}\n",
		"misplaced field": "apiVersion: policy/v1\nkind: PodDisruptionBudget\nmetadata: {name: a}\nminAvailable: 1\n",
	} {
		if _, err := deployDecode([]byte(doc)); err == nil {
			t.Errorf("%s: decoded without error", name)
		}
	}
	if o, err := deployDecode([]byte("apiVersion: v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: [{port: 80, targetPort: http}]}\n")); err != nil || o == nil {
		t.Errorf("a valid Service: %v", err)
	}
}

// TestDeployManifests builds every kustomization under deploy/ and checks
// each build (see the file comment).
func TestDeployManifests(t *testing.T) {
	rawSecrets := deployRawSecrets(t)
	dirs, bases := deployKustomizations(t)
	if len(dirs) < 3 {
		t.Fatalf("kustomizations under deploy/: %v; want base and the overlays", dirs)
	}
	leaves := 0
	for _, dir := range dirs {
		t.Run(strings.ReplaceAll(dir, "/", "_"), func(t *testing.T) {
			b := deployRun(t, dir)
			leaf := !bases[dir]
			if leaf {
				leaves++
			}
			deployCheckBuild(t, b, leaf, rawSecrets)
		})
	}
	if leaves < 2 {
		t.Errorf("%d kustomizations meant to be applied; want at least the aggregated and the PD overlays", leaves)
	}
}

// deployCheckBuild runs every check on one build. A base (leaf false) is
// not applied alone: it names no model-server pool, so kvroute's arguments
// are parsed but not validated as a whole, and the pool wiring is not
// checked.
func deployCheckBuild(t *testing.T, b *deployBuild, leaf bool, rawSecrets []*corev1.Secret) {
	where := "deploy/" + b.Dir
	fail := func(format string, a ...any) { t.Helper(); t.Errorf(where+": "+format, a...) }

	// One namespace for everything, so the DNS names in kvroute's args hold.
	for _, o := range b.Objects {
		if o.Kind == "Namespace" {
			continue
		}
		if o.Namespace != deployNamespace {
			fail("%s/%s is in namespace %q, want %q (kustomization namespace:)", o.Kind, o.Name, o.Namespace, deployNamespace)
		}
	}

	// Workloads: selectors select their own templates.
	for _, w := range b.Workloads {
		if w.Selector == nil || len(w.Selector.MatchLabels) == 0 {
			fail("%s has no selector.matchLabels", w)
			continue
		}
		if !deploySelects(w.Selector.MatchLabels, w.Template.Labels) {
			fail("%s: selector %v does not match its pod template's labels %v", w, w.Selector.MatchLabels, w.Template.Labels)
		}
		deployCheckProbes(t, where, w)
	}

	// Services select pods of this build, on ports those pods declare.
	external := deployExternalPods[b.Dir]
	for _, s := range b.Services {
		if len(s.Spec.Selector) == 0 {
			fail("Service %s has no selector", s.Name)
			continue
		}
		sel := deploySelected(b, s.Spec.Selector)
		if len(sel) == 0 {
			if !slices.Contains(external, s.Name) {
				fail("Service %s: selector %v matches the pod template of no Deployment or StatefulSet in the build", s.Name, s.Spec.Selector)
			}
			continue
		}
		if len(s.Spec.Ports) == 0 {
			fail("Service %s has no ports", s.Name)
		}
		for _, p := range s.Spec.Ports {
			target := p.TargetPort
			if target.Type == intstr.Int && target.IntVal == 0 {
				target = intstr.FromInt32(p.Port) // unset: the port itself
			}
			for _, w := range sel {
				if _, ok := deployContainerPort(w.Template, target); !ok {
					fail("Service %s port %d: targetPort %s is no containerPort of %s (selected by %v)", s.Name, p.Port, target.String(), w, s.Spec.Selector)
				}
			}
		}
	}

	// Every PodDisruptionBudget protects pods of the build.
	for _, p := range b.PDBs {
		if p.Spec.Selector == nil || len(deploySelected(b, p.Spec.Selector.MatchLabels)) == 0 {
			fail("PodDisruptionBudget %s selects no pods of the build", p.Name)
		}
	}

	// kvroute's workload, then the model servers'.
	var kv *deployWorkload
	for i, w := range b.Workloads {
		for _, c := range w.Template.Spec.Containers {
			if c.Name == kvrouteContainer {
				if kv != nil {
					fail("two workloads run kvroute: %s and %s", kv, w)
				}
				kv = &b.Workloads[i]
			}
		}
	}
	if kv == nil {
		fail("no Deployment runs a container named %q", kvrouteContainer)
		return
	}
	deployCheckKvroute(t, b, *kv, leaf, rawSecrets)
	for _, w := range b.Workloads {
		for _, c := range w.Template.Spec.Containers {
			if strings.HasPrefix(c.Image, vllmImage) {
				deployCheckVLLM(t, where, w, c)
			}
		}
	}
}

// deploySelects reports whether selector selects a pod labelled labels.
func deploySelects(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// deploySelected returns the workloads whose pods selector selects.
func deploySelected(b *deployBuild, selector map[string]string) []deployWorkload {
	var out []deployWorkload
	for _, w := range b.Workloads {
		if deploySelects(selector, w.Template.Labels) {
			out = append(out, w)
		}
	}
	return out
}

// deployContainerPort finds a container port of the pod by name or number.
func deployContainerPort(pod *corev1.PodTemplateSpec, port intstr.IntOrString) (corev1.ContainerPort, bool) {
	for _, c := range pod.Spec.Containers {
		if p, ok := deployPortOf(c, port); ok {
			return p, true
		}
	}
	return corev1.ContainerPort{}, false
}

func deployPortOf(c corev1.Container, port intstr.IntOrString) (corev1.ContainerPort, bool) {
	for _, p := range c.Ports {
		if (port.Type == intstr.String && p.Name == port.StrVal) || (port.Type == intstr.Int && p.ContainerPort == port.IntVal) {
			return p, true
		}
	}
	return corev1.ContainerPort{}, false
}

// deployCheckProbes: every probe's port is a port its container declares.
func deployCheckProbes(t *testing.T, where string, w deployWorkload) {
	for _, c := range w.Template.Spec.Containers {
		for kind, p := range map[string]*corev1.Probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe, "startup": c.StartupProbe} {
			if p == nil {
				continue
			}
			var port intstr.IntOrString
			switch {
			case p.HTTPGet != nil:
				port = p.HTTPGet.Port
			case p.TCPSocket != nil:
				port = p.TCPSocket.Port
			case p.GRPC != nil:
				port = intstr.FromInt32(p.GRPC.Port)
			default:
				continue
			}
			if _, ok := deployPortOf(c, port); !ok {
				t.Errorf("%s: %s container %s: %s probe port %s is not one of its ports", where, w, c.Name, kind, port.String())
			}
		}
	}
}

// deployEnvValue is the value a container's environment gives name, "" if
// unset; a value from a Secret or a field stands for "from-ref".
func deployEnvValue(c corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			if e.ValueFrom != nil {
				return "from-ref"
			}
			return e.Value
		}
	}
	return ""
}

// deployCheckKvroute checks the router's workload in build b.
func deployCheckKvroute(t *testing.T, b *deployBuild, w deployWorkload, leaf bool, rawSecrets []*corev1.Secret) {
	where := "deploy/" + b.Dir + ": " + w.String()
	fail := func(format string, a ...any) { t.Helper(); t.Errorf(where+": "+format, a...) }
	pod := w.Template.Spec
	var c corev1.Container
	for _, x := range pod.Containers {
		if x.Name == kvrouteContainer {
			c = x
		}
	}
	if w.Kind != "Deployment" {
		fail("kvroute should be a Deployment (it keeps no state), not a %s", w.Kind)
	}
	if w.Replicas < 2 {
		fail("replicas %d: want at least 2", w.Replicas)
	}
	if c.Image == "" || c.Image == kvrouteContainer || strings.HasSuffix(c.Image, ":latest") || !strings.Contains(c.Image, ":") {
		fail("image %q: want REGISTRY/kvroute:VERSION (kustomization images:)", c.Image)
	}

	cfg := deployCheckArgs(t, fail, c, leaf)
	if cfg == nil {
		return
	}
	// The args as kvroute's flags take them, to tell which they set.
	flags := newFlags(&config{Config: app.DefaultConfig()})
	if err := flags.Parse(c.Args, io.Discard); err != nil {
		t.Fatal(err)
	}
	deployCheckRollout(fail, pod, c, cfg, flags)
	httpPort := deployCheckPorts(t, fail, w, c, cfg)
	deployCheckResources(fail, c)
	deployCheckPodSecurity(fail, b, w, c)
	// The admin token comes from a Secret that exists.
	deployCheckAdminToken(t, fail, b, c, rawSecrets)
	deployCheckGossip(fail, b, w, c, cfg, rawSecrets)
	deployCheckBudgets(fail, b, w, c, cfg)
	deployCheckClientService(fail, b, w, httpPort)
	deployCheckPDB(fail, b, w)
	if leaf {
		deployCheckPools(fail, b, w, cfg, flags)
	}
}

// deployCheckArgs checks kvroute's arguments in container c: every one a
// flag kvroute has and parses, the environment included (KVROUTE_*), and,
// in a leaf build, the whole configuration valid. It returns the
// configuration, nil when kvroute does not parse the args.
func deployCheckArgs(t *testing.T, fail func(string, ...any), c corev1.Container, leaf bool) *config {
	t.Helper()
	for _, a := range c.Args {
		if !strings.HasPrefix(a, "--") {
			fail("arg %q: want --flag=value", a)
		}
	}
	if len(c.Command) > 0 {
		fail("command %q overrides the image's entrypoint: use args", c.Command)
	}
	flags := newFlags(&config{Config: app.DefaultConfig()})
	if err := flags.Parse(nil, io.Discard); err != nil {
		t.Fatal(err)
	}
	all := flags.All()
	for _, e := range c.Env {
		if name, ok := strings.CutPrefix(e.Name, "KVROUTE_"); ok {
			flag := strings.ToLower(strings.ReplaceAll(name, "_", "-"))
			if all.Lookup(flag) == nil {
				fail("env %s: kvroute has no flag --%s, so it would be ignored", e.Name, flag)
			}
		}
	}
	cfg, err := parseConfig(c.Args, func(k string) string { return deployEnvValue(c, k) }, io.Discard)
	if err != nil {
		fail("kvroute does not parse its args %q: %v", c.Args, err)
		return nil
	}
	if leaf {
		v := *cfg
		if v.GossipKeyFile != "" { // mounted from a Secret the operator creates (deployCheckGossip)
			v.GossipKeyFile = filepath.Join(t.TempDir(), "key")
			if err := os.WriteFile(v.GossipKeyFile, []byte("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\n"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		if err := v.Validate(); err != nil {
			fail("kvroute rejects its configuration (args %q):\n%v", c.Args, err)
		}
	}
	return cfg
}

// deployCheckGossip: the replicas gossip (--peers-service) through a
// headless Service of the build that selects their pods, publishes them
// before they are ready (a replica is ready only once it has met its
// peers) and carries the gossip port over TCP and UDP to container ports
// of that number; the key file is mounted from a Secret that the build or
// an example under deploy/ defines, with that key.
func deployCheckGossip(fail func(string, ...any), b *deployBuild, w deployWorkload, c corev1.Container, cfg *config, rawSecrets []*corev1.Secret) {
	if cfg.PeersService == "" {
		fail("args do not set --peers-service: replicas would not share their placements")
		return
	}
	name, port, err := net.SplitHostPort(cfg.PeersService)
	if err != nil {
		fail("--peers-service=%s: want NAME:PORT", cfg.PeersService)
		return
	}
	var svc *corev1.Service
	for _, s := range b.Services {
		if s.Name == name {
			svc = s
		}
	}
	switch {
	case svc == nil:
		fail("--peers-service names Service %q, which the build lacks", name)
		return
	case svc.Spec.ClusterIP != corev1.ClusterIPNone:
		fail("Service %s is not headless: DNS would give one virtual IP, not the replicas", name)
	case !svc.Spec.PublishNotReadyAddresses:
		fail("Service %s must publish not-ready addresses: a replica is not ready before it has met its peers", name)
	case !deploySelects(svc.Spec.Selector, w.Template.Labels):
		fail("Service %s does not select the kvroute pods", name)
	}
	for _, proto := range []corev1.Protocol{corev1.ProtocolTCP, corev1.ProtocolUDP} {
		ok := false
		for _, sp := range svc.Spec.Ports {
			if strconv.Itoa(int(sp.Port)) != port || sp.Protocol != proto {
				continue
			}
			cp, found := deployPortOf(c, sp.TargetPort)
			ok = found && cp.Protocol == proto && strconv.Itoa(int(cp.ContainerPort)) == port
		}
		if !ok {
			fail("Service %s: no %s port %s to a container port of that number (memberlist gossips over both)", name, proto, port)
		}
	}
	if want := ":" + port; cfg.GossipListen != want && !strings.HasSuffix(cfg.GossipListen, want) {
		fail("--gossip-listen %s is not the Service's port %s", cfg.GossipListen, port)
	}
	deployCheckSecretFile(fail, b, w, c, "--gossip-key-file", cfg.GossipKeyFile, rawSecrets)
}

// deployCheckSecretFile: path (flag's value) is a file of a volume mounted
// from a Secret that the build or an example under deploy/ defines, with
// the file's name as a key.
func deployCheckSecretFile(fail func(string, ...any), b *deployBuild, w deployWorkload, c corev1.Container, flag, path string, rawSecrets []*corev1.Secret) {
	if path == "" {
		fail("args do not set %s", flag)
		return
	}
	for _, m := range c.VolumeMounts {
		rel, ok := strings.CutPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/")
		if !ok {
			continue
		}
		for _, v := range w.Template.Spec.Volumes {
			if v.Name != m.Name || v.Secret == nil {
				continue
			}
			for _, s := range append(slices.Clone(b.Secrets), rawSecrets...) {
				if s.Name != v.Secret.SecretName {
					continue
				}
				_, inData := s.Data[rel]
				_, inString := s.StringData[rel]
				if inData || inString {
					return
				}
			}
			fail("%s=%s: Secret %s has no key %s in the build or an example under deploy/", flag, path, v.Secret.SecretName, rel)
			return
		}
	}
	fail("%s=%s is not in a volume mounted from a Secret", flag, path)
}

// deployCheckBudgets: a --tenant-budgets file is a key of a ConfigMap of
// the build, mounted as a directory (a subPath mount never sees the
// ConfigMap's updates, which kvroute reloads), and kvroute takes it.
func deployCheckBudgets(fail func(string, ...any), b *deployBuild, w deployWorkload, c corev1.Container, cfg *config) {
	path := cfg.BudgetsFile
	if path == "" {
		return
	}
	for _, m := range c.VolumeMounts {
		rel, ok := strings.CutPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/")
		if !ok {
			continue
		}
		if m.SubPath != "" {
			fail("--tenant-budgets=%s is mounted with subPath: the ConfigMap's updates never reach it", path)
		}
		for _, v := range w.Template.Spec.Volumes {
			if v.Name != m.Name || v.ConfigMap == nil {
				continue
			}
			for _, cm := range b.Maps {
				if cm.Name != v.ConfigMap.Name {
					continue
				}
				text, ok := cm.Data[rel]
				if !ok {
					fail("--tenant-budgets=%s: ConfigMap %s has no key %s", path, cm.Name, rel)
				} else if _, err := proxy.ParseBudgets([]byte(text)); err != nil {
					fail("--tenant-budgets=%s: ConfigMap %s: %v", path, cm.Name, err)
				}
				return
			}
			fail("--tenant-budgets=%s: no ConfigMap %s in the build", path, v.ConfigMap.Name)
			return
		}
	}
	fail("--tenant-budgets=%s is not in a volume mounted from a ConfigMap", path)
}

// deployCheckRollout checks that the rollout is graceful: the args (flags)
// set --shutdown-delay and --drain-timeout, which fit in pod's grace
// period, and c has no preStop hook.
func deployCheckRollout(fail func(string, ...any), pod corev1.PodSpec, c corev1.Container, cfg *config, flags *app.Flags) {
	var delay time.Duration
	var err error
	switch f := flags.All().Lookup("shutdown-delay"); {
	case f == nil:
		fail("kvroute has no --shutdown-delay flag (yet?)")
	case !f.Changed:
		fail("args do not set --shutdown-delay (want --shutdown-delay=5s)")
	default:
		if delay, err = flags.All().GetDuration("shutdown-delay"); err != nil {
			fail("--shutdown-delay: %v", err)
		} else if delay <= 0 {
			fail("--shutdown-delay=%s: want a positive delay, so the Service drops the pod before it stops accepting", delay)
		}
	}
	if !flags.All().Changed("drain-timeout") {
		fail("args do not set --drain-timeout")
	}
	grace := int64(corev1.DefaultTerminationGracePeriodSeconds)
	if pod.TerminationGracePeriodSeconds != nil {
		grace = *pod.TerminationGracePeriodSeconds
	}
	if need := delay + cfg.DrainTimeout; time.Duration(grace)*time.Second <= need {
		fail("terminationGracePeriodSeconds %d must exceed --shutdown-delay + --drain-timeout = %s, or the kubelet kills streams kvroute is still draining", grace, need)
	}
	if c.Lifecycle != nil && c.Lifecycle.PreStop != nil {
		fail("a preStop hook: the image is distroless (no shell) and --shutdown-delay replaces it")
	}
}

// deployCheckPorts checks that c's ports, probes and w's scrape
// annotations agree with kvroute's listeners, and returns c's http port.
func deployCheckPorts(t *testing.T, fail func(string, ...any), w deployWorkload, c corev1.Container, cfg *config) corev1.ContainerPort {
	t.Helper()
	httpPort, ok := deployPortOf(c, intstr.FromString("http"))
	if !ok {
		fail("no container port named http")
	} else if want := deployListenPort(t, cfg.Listen); httpPort.ContainerPort != want {
		fail("port http is %d, but kvroute listens on %s", httpPort.ContainerPort, cfg.Listen)
	} else if want != 8000 {
		fail("API port %d: want 8000, the vLLM port clients use", want)
	}
	adminPort, ok := deployPortOf(c, intstr.FromString("admin"))
	if !ok {
		fail("no container port named admin")
	} else if want := deployListenPort(t, cfg.AdminListen); adminPort.ContainerPort != want {
		fail("port admin is %d, but kvroute's admin listener is %s", adminPort.ContainerPort, cfg.AdminListen)
	}
	deployCheckHTTPProbe(fail, "readiness", c.ReadinessProbe, "/readyz", "admin")
	deployCheckHTTPProbe(fail, "liveness", c.LivenessProbe, "/livez", "admin")
	ann := w.Template.Annotations
	for k, v := range map[string]string{"prometheus.io/scrape": "true", "prometheus.io/port": strconv.Itoa(int(adminPort.ContainerPort)), "prometheus.io/path": "/metrics"} {
		if ann[k] != v {
			fail("pod annotation %s is %q, want %q", k, ann[k], v)
		}
	}
	return httpPort
}

// deployCheckResources checks c's resources: requests for scheduling, a
// memory limit, and a Go memory limit below it when set.
func deployCheckResources(fail func(string, ...any), c corev1.Container) {
	req, lim := c.Resources.Requests, c.Resources.Limits
	if req.Cpu().IsZero() || req.Memory().IsZero() {
		fail("resources.requests must set cpu and memory, got %v", req)
	}
	if lim.Memory().IsZero() {
		fail("resources.limits must set memory")
	} else if v := deployEnvValue(c, "GOMEMLIMIT"); v != "" {
		n, err := deployGoMemLimit(v)
		if err != nil {
			fail("GOMEMLIMIT %q: %v", v, err)
		} else if n >= lim.Memory().Value() {
			fail("GOMEMLIMIT %s is not below the memory limit %s", v, lim.Memory())
		}
	}
}

// deployCheckPodSecurity checks the security of kvroute's pod (w's, of
// build b, running c): the restricted Pod Security Standard, no API token
// (neither the pod's nor its ServiceAccount's), no Service links, and
// topology spread over its own pods.
func deployCheckPodSecurity(fail func(string, ...any), b *deployBuild, w deployWorkload, c corev1.Container) {
	pod := w.Template.Spec
	deployCheckSecurity(fail, pod, c)
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		fail("automountServiceAccountToken must be false: discovery is DNS, kvroute needs no API access")
	}
	if pod.ServiceAccountName != "" {
		found := false
		for _, sa := range b.SAs {
			if sa.Name == pod.ServiceAccountName {
				found = true
				if sa.AutomountServiceAccountToken == nil || *sa.AutomountServiceAccountToken {
					fail("ServiceAccount %s: automountServiceAccountToken must be false", sa.Name)
				}
			}
		}
		if !found {
			fail("serviceAccountName %q is not in the build", pod.ServiceAccountName)
		}
	}
	if pod.EnableServiceLinks == nil || *pod.EnableServiceLinks {
		fail("enableServiceLinks must be false: a Service named kvroute* would inject KVROUTE_* variables, which kvroute reads as flags")
	}
	for _, tsc := range pod.TopologySpreadConstraints {
		if tsc.LabelSelector == nil || !deploySelects(tsc.LabelSelector.MatchLabels, w.Template.Labels) {
			fail("topologySpreadConstraint on %s does not select kvroute's own pods", tsc.TopologyKey)
		}
	}
}

// deployCheckClientService checks that the Service clients use in build b
// selects kvroute (w, serving on httpPort), and only kvroute.
func deployCheckClientService(fail func(string, ...any), b *deployBuild, w deployWorkload, httpPort corev1.ContainerPort) {
	want := deployClientService[b.Dir]
	if want == "" {
		want = "vllm"
	}
	var client *corev1.Service
	for _, s := range b.Services {
		if s.Name == want {
			client = s
		}
		if deploySelects(s.Spec.Selector, w.Template.Labels) {
			for _, o := range deploySelected(b, s.Spec.Selector) {
				if o.Name != w.Name {
					fail("Service %s selects both kvroute and %s", s.Name, o)
				}
			}
		}
	}
	switch {
	case client == nil:
		fail("no Service %q for the clients", want)
	case client.Spec.ClusterIP == corev1.ClusterIPNone:
		fail("Service %s is headless; clients need a ClusterIP", client.Name)
	case !deploySelects(client.Spec.Selector, w.Template.Labels):
		fail("Service %s (the clients') does not select the kvroute pods: selector %v", client.Name, client.Spec.Selector)
	default:
		ok := false
		for _, p := range client.Spec.Ports {
			if p.Port == 8000 {
				ok = p.TargetPort == intstr.FromString("http") || p.TargetPort == intstr.FromInt32(httpPort.ContainerPort)
			}
		}
		if !ok {
			fail("Service %s: want port 8000 to kvroute's http port", client.Name)
		}
	}
}

// deployCheckPDB checks that one PodDisruptionBudget of build b, selecting
// kvroute (w) alone, keeps a router up through node drains.
func deployCheckPDB(fail func(string, ...any), b *deployBuild, w deployWorkload) {
	pdbs := 0
	for _, p := range b.PDBs {
		if p.Spec.Selector == nil || !deploySelects(p.Spec.Selector.MatchLabels, w.Template.Labels) {
			continue
		}
		pdbs++
		for _, o := range deploySelected(b, p.Spec.Selector.MatchLabels) {
			if o.Name != w.Name {
				fail("PodDisruptionBudget %s also selects %s", p.Name, o)
			}
		}
		switch {
		case p.Spec.MinAvailable != nil && p.Spec.MaxUnavailable != nil:
			fail("PodDisruptionBudget %s sets both minAvailable and maxUnavailable", p.Name)
		case p.Spec.MinAvailable != nil:
			if p.Spec.MinAvailable.Type != intstr.Int || p.Spec.MinAvailable.IntVal < 1 || p.Spec.MinAvailable.IntVal >= w.Replicas {
				fail("PodDisruptionBudget %s: minAvailable %s must be in [1, replicas-1], or no node could ever drain", p.Name, p.Spec.MinAvailable.String())
			}
		case p.Spec.MaxUnavailable != nil:
			if p.Spec.MaxUnavailable.Type != intstr.Int || p.Spec.MaxUnavailable.IntVal < 1 || p.Spec.MaxUnavailable.IntVal >= w.Replicas {
				fail("PodDisruptionBudget %s: maxUnavailable %s must be in [1, replicas-1]", p.Name, p.Spec.MaxUnavailable.String())
			}
		default:
			fail("PodDisruptionBudget %s sets neither minAvailable nor maxUnavailable", p.Name)
		}
	}
	if pdbs != 1 {
		fail("%d PodDisruptionBudgets select kvroute; want 1", pdbs)
	}
}

// deployCheckPools checks the pools kvroute (w, configured by cfg from the
// args flags parsed) discovers in a leaf build b: headless Services of this
// build, named NAME.NAMESPACE.svc.cluster.local:PORT, selecting
// model-server pods (a PD pool's labelled with its role), and a PD
// deployment's protocol said.
func deployCheckPools(fail func(string, ...any), b *deployBuild, w deployWorkload, cfg *config, flags *app.Flags) {
	pools := 0
	for _, p := range []struct{ flag, value, role string }{
		{"--service", cfg.Service, ""}, {"--prefill-service", cfg.PrefillService, "prefill"}, {"--decode-service", cfg.DecodeService, "decode"},
	} {
		if p.value == "" {
			continue
		}
		pools++
		s := deployCheckPoolService(fail, b, w, p.flag, p.value)
		if s == nil {
			continue
		}
		for _, o := range deploySelected(b, s.Spec.Selector) {
			if p.role != "" && o.Template.Labels["role"] != p.role {
				fail("%s=%s selects %s, whose pods are not labelled role: %s", p.flag, p.value, o, p.role)
			}
			if p.role != "" && cfg.PDProtocol == proxy.ProtocolVLLM {
				deployCheckNixl(fail, o)
			}
		}
	}
	if pools == 0 && len(cfg.Backends)+len(cfg.PrefillBackends)+len(cfg.DecodeBackends) == 0 {
		fail("kvroute names no pool (--service, --prefill-service/--decode-service)")
	}
	if (cfg.PrefillService != "" || cfg.DecodeService != "") && !flags.All().Changed("pd-protocol") {
		fail("a PD deployment should say its protocol: --pd-protocol=vllm (or sglang)")
	}
}

// deployListenPort is the port of a host:port listen address.
func deployListenPort(t *testing.T, addr string) int32 {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("listen address %q: %v", addr, err)
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("listen address %q: %v", addr, err)
	}
	return int32(n)
}

func deployCheckHTTPProbe(fail func(string, ...any), kind string, p *corev1.Probe, path, port string) {
	switch {
	case p == nil:
		fail("no %s probe", kind)
	case p.HTTPGet == nil:
		fail("%s probe: want GET %s on port %s", kind, path, port)
	case p.HTTPGet.Path != path || p.HTTPGet.Port != intstr.FromString(port):
		fail("%s probe is GET %s on port %s, want GET %s on port %s", kind, p.HTTPGet.Path, p.HTTPGet.Port.String(), path, port)
	}
}

// deployCheckSecurity: non-root as distroless's nonroot user, read-only
// root, no privilege escalation, no capabilities, the runtime's seccomp
// profile. Container settings win over the pod's.
func deployCheckSecurity(fail func(string, ...any), pod corev1.PodSpec, c corev1.Container) {
	psc := pod.SecurityContext
	if psc == nil {
		psc = &corev1.PodSecurityContext{}
	}
	csc := c.SecurityContext
	if csc == nil {
		fail("no container securityContext")
		return
	}
	nonRoot, user, seccomp := psc.RunAsNonRoot, psc.RunAsUser, psc.SeccompProfile
	if csc.RunAsNonRoot != nil {
		nonRoot = csc.RunAsNonRoot
	}
	if csc.RunAsUser != nil {
		user = csc.RunAsUser
	}
	if csc.SeccompProfile != nil {
		seccomp = csc.SeccompProfile
	}
	if nonRoot == nil || !*nonRoot {
		fail("securityContext: runAsNonRoot must be true")
	}
	if user == nil || *user != 65532 {
		fail("securityContext: runAsUser must be 65532 (distroless nonroot)")
	}
	if seccomp == nil || seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault {
		fail("securityContext: seccompProfile must be RuntimeDefault")
	}
	if csc.ReadOnlyRootFilesystem == nil || !*csc.ReadOnlyRootFilesystem {
		fail("securityContext: readOnlyRootFilesystem must be true")
	}
	if csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation {
		fail("securityContext: allowPrivilegeEscalation must be false")
	}
	if csc.Privileged != nil && *csc.Privileged {
		fail("securityContext: privileged")
	}
	if csc.Capabilities == nil || !slices.Contains(csc.Capabilities.Drop, "ALL") || len(csc.Capabilities.Add) > 0 {
		fail("securityContext: capabilities must drop ALL and add none")
	}
}

// deployCheckAdminToken: KVROUTE_ADMIN_TOKEN comes from a Secret key that
// the build or an example manifest under deploy/ defines.
func deployCheckAdminToken(t *testing.T, fail func(string, ...any), b *deployBuild, c corev1.Container, rawSecrets []*corev1.Secret) {
	var ref *corev1.SecretKeySelector
	for _, e := range c.Env {
		if e.Name == "KVROUTE_ADMIN_TOKEN" && e.ValueFrom != nil {
			ref = e.ValueFrom.SecretKeyRef
		}
	}
	if ref == nil {
		fail("env KVROUTE_ADMIN_TOKEN must come from a Secret (valueFrom.secretKeyRef)")
		return
	}
	if slices.Contains(c.Args, "--admin-token") || slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, "--admin-token=") }) {
		fail("--admin-token in args puts the token in the pod spec; use the Secret")
	}
	has := func(s *corev1.Secret) bool {
		if s.Name != ref.Name || (s.Namespace != "" && s.Namespace != deployNamespace) {
			return false
		}
		_, inData := s.Data[ref.Key]
		_, inString := s.StringData[ref.Key]
		return inData || inString
	}
	for _, s := range b.Secrets {
		if has(s) {
			return
		}
	}
	for _, s := range rawSecrets {
		if has(s) {
			t.Logf("deploy/%s: KVROUTE_ADMIN_TOKEN from Secret %s key %s: created before applying (example manifest under deploy/)", b.Dir, ref.Name, ref.Key)
			return
		}
	}
	fail("KVROUTE_ADMIN_TOKEN reads Secret %s key %s, which neither the build, a secretGenerator nor an example under deploy/ defines", ref.Name, ref.Key)
}

// deployCheckPoolService resolves a pool flag's value to a headless
// Service of the build and checks its port.
func deployCheckPoolService(fail func(string, ...any), b *deployBuild, kv deployWorkload, flag, value string) *corev1.Service {
	host, port, err := net.SplitHostPort(value)
	if err != nil {
		fail("%s=%s: want NAME.NAMESPACE.svc.cluster.local:PORT (%v)", flag, value, err)
		return nil
	}
	name, ns, _ := strings.Cut(host, ".")
	if ns == "" {
		ns = kv.Namespace
	} else {
		var rest string
		ns, rest, _ = strings.Cut(ns, ".")
		if rest != "svc.cluster.local" && rest != "svc" && rest != "" {
			fail("%s=%s: want NAME.NAMESPACE.svc.cluster.local", flag, value)
		}
	}
	var s *corev1.Service
	for _, x := range b.Services {
		if x.Name == name && x.Namespace == ns {
			s = x
		}
	}
	if s == nil {
		fail("%s=%s: no Service %s in namespace %s in the build", flag, value, name, ns)
		return nil
	}
	if s.Spec.ClusterIP != corev1.ClusterIPNone {
		fail("%s=%s: Service %s must be headless (clusterIP: None) so DNS lists every pod", flag, value, name)
	}
	if s.Spec.PublishNotReadyAddresses {
		fail("Service %s publishes pods that are not ready: kvroute would route to loading engines", name)
	}
	found := false
	for _, p := range s.Spec.Ports {
		if strconv.Itoa(int(p.Port)) == port || p.Name == port {
			found = true
		}
	}
	if !found {
		fail("%s=%s: Service %s has no port %s", flag, value, name, port)
	}
	if deploySelects(s.Spec.Selector, kv.Template.Labels) {
		fail("%s=%s: Service %s selects the kvroute pods themselves", flag, value, name)
	}
	return s
}

// deployCheckNixl: a pod of a vLLM PD pool runs the NixlConnector and
// tells the other pool where its side channel is.
func deployCheckNixl(fail func(string, ...any), w deployWorkload) {
	for _, c := range w.Template.Spec.Containers {
		if !strings.HasPrefix(c.Image, vllmImage) {
			continue
		}
		cfg := deployVLLMArg(c.Args, "--kv-transfer-config")
		var kt struct {
			Connector string `json:"kv_connector"`
			Role      string `json:"kv_role"`
		}
		if err := json.Unmarshal([]byte(cfg), &kt); err != nil {
			fail("%s: --kv-transfer-config %q is not JSON: %v", w, cfg, err)
		} else if kt.Connector != "NixlConnector" || !slices.Contains([]string{"kv_both", "kv_producer", "kv_consumer"}, kt.Role) {
			fail("%s: --kv-transfer-config %s: want kv_connector NixlConnector and a kv_role", w, cfg)
		}
		var host, port *corev1.EnvVar
		for i, e := range c.Env {
			switch e.Name {
			case "VLLM_NIXL_SIDE_CHANNEL_HOST":
				host = &c.Env[i]
			case "VLLM_NIXL_SIDE_CHANNEL_PORT":
				port = &c.Env[i]
			}
		}
		if host == nil || host.ValueFrom == nil || host.ValueFrom.FieldRef == nil || host.ValueFrom.FieldRef.FieldPath != "status.podIP" {
			fail("%s: VLLM_NIXL_SIDE_CHANNEL_HOST must come from status.podIP (the other pool connects to it)", w)
		}
		if port == nil {
			fail("%s: no VLLM_NIXL_SIDE_CHANNEL_PORT", w)
		} else if n, err := strconv.Atoi(port.Value); err != nil {
			fail("%s: VLLM_NIXL_SIDE_CHANNEL_PORT %q is not a port", w, port.Value)
		} else if _, ok := deployPortOf(c, intstr.FromInt32(int32(n))); !ok {
			fail("%s: the NIXL side channel port %d is not a declared containerPort", w, n)
		}
	}
}

// deployVLLMArg returns the value of a vLLM flag in args (--flag=value or
// --flag value), "" when absent; a flag without value returns "true".
func deployVLLMArg(args []string, flag string) string {
	for i, a := range args {
		if v, ok := strings.CutPrefix(a, flag+"="); ok {
			return v
		}
		if a == flag {
			if i+1 < len(args) && !strings.HasPrefix(args[i+1], "--") {
				return args[i+1]
			}
			return "true"
		}
	}
	return ""
}

// deployCheckVLLM checks an example vLLM container.
func deployCheckVLLM(t *testing.T, where string, w deployWorkload, c corev1.Container) {
	fail := func(format string, a ...any) { t.Helper(); t.Errorf(where+": "+w.String()+": "+format, a...) }
	pod := w.Template.Spec
	if pod.EnableServiceLinks == nil || *pod.EnableServiceLinks {
		fail("enableServiceLinks must be false: Services named vllm* inject VLLM_PORT=tcp://... and other VLLM_* variables vLLM reads as settings")
	}
	if strings.HasSuffix(c.Image, ":latest") || !strings.Contains(c.Image, ":") {
		fail("image %q: pin a vLLM release", c.Image)
	}
	for _, f := range []string{"--model", "--served-model-name", "--enable-prefix-caching", "--enable-prompt-tokens-details"} {
		if deployVLLMArg(c.Args, f) == "" {
			fail("args lack %s", f)
		}
	}
	if p := deployVLLMArg(c.Args, "--port"); p != "" && p != "8000" {
		fail("--port %s: kvroute and the headless Services expect 8000", p)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/health" {
		fail("readiness probe: want GET /health (only ready pods enter the headless Service)")
	} else if p, ok := deployPortOf(c, c.ReadinessProbe.HTTPGet.Port); !ok || p.ContainerPort != 8000 {
		fail("readiness probe on port %s: want the API port 8000", c.ReadinessProbe.HTTPGet.Port.String())
	}
	gpu := corev1.ResourceName("nvidia.com/gpu")
	if q, ok := c.Resources.Limits[gpu]; !ok || q.Cmp(resource.MustParse("1")) < 0 {
		fail("resources.limits: want nvidia.com/gpu")
	}
}

// deployGoMemLimit parses a GOMEMLIMIT value (bytes, optional B/KiB/MiB/GiB/TiB).
func deployGoMemLimit(v string) (int64, error) {
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		m      int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"B", 1}} {
		if s, ok := strings.CutSuffix(v, u.suffix); ok {
			v, mult = s, u.m
			break
		}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, err
	}
	return n * mult, nil
}

// deployREADMEOtherFlags are the flags deploy/README.md gives to tools
// other than kvroute (docker, kubectl, git, vLLM); any other --flag there
// must be one of kvroute's.
var deployREADMEOtherFlags = []string{
	"--always", "--tags", "--build-arg", "--from-file", "--from-literal", "--image", "--restart", "--rm", "--timeout", "--type",
	"--model", "--served-model-name", "--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-transfer-config",
	"--gpu-memory-utilization", "--max-num-seqs", "--max-model-len",
}

var (
	deployREADMEFlag   = regexp.MustCompile(`--[a-z][a-z0-9-]*`)
	deployREADMEMetric = regexp.MustCompile(`\b((?:kvroute|llm|process|go)_[a-z0-9_]+)(\{[^}]*\})?`)
	deployREADMELabel  = regexp.MustCompile(`([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)`)
)

// TestDeployREADME keeps the operator's guide true to the code: every
// kvroute flag it names exists, and every metric it names is exported,
// with the labels it shows.
func TestDeployREADME(t *testing.T) {
	data, err := os.ReadFile(filepath.Join(deployDir, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	flags := newFlags(&config{Config: app.DefaultConfig()})
	if err := flags.Parse(nil, io.Discard); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, f := range deployREADMEFlag.FindAllString(text, -1) {
		if seen[f] {
			continue
		}
		seen[f] = true
		if flags.All().Lookup(strings.TrimPrefix(f, "--")) == nil && !slices.Contains(deployREADMEOtherFlags, f) {
			t.Errorf("deploy/README.md: %s is not a kvroute flag (kvroute --help); if another tool's, add it to deployREADMEOtherFlags", f)
		}
	}
	metrics := dashLoadMetrics(t)
	n := 0
	for _, m := range deployREADMEMetric.FindAllStringSubmatch(text, -1) {
		n++
		_, fam, suffix, ok := dashResolve(metrics, m[1])
		if !ok {
			t.Errorf("deploy/README.md: %s is not a metric kvroute exports (%s)", m[1], metricsGolden)
			continue
		}
		for _, l := range deployREADMELabel.FindAllStringSubmatch(m[2], -1) {
			if !slices.Contains(fam.Labels, l[1]) && !(l[1] == "le" && suffix == "_bucket") && !slices.Contains(dashTargetLabels, l[1]) {
				t.Errorf("deploy/README.md: %s has no label %q (it has %v)", m[1], l[1], fam.Labels)
			}
		}
	}
	if n < 10 {
		t.Errorf("deploy/README.md names only %d metrics; its troubleshooting table should name the metric of each symptom", n)
	}
}
