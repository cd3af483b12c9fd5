// Command check validates Kubernetes manifests offline against the API's
// own types: every document is decoded strictly with client-go's scheme
// (the types the API server serves) and external-snapshotter's (the
// VolumeSnapshotClass of the snapshot CRDs), so an unknown kind or apiVersion, a
// field that does not exist (a typo) or a value of the wrong type is an
// error naming the file and the field. scripts/check-kubernetes runs it
// on deploy/kubernetes/*.yaml.
//
//	go run . ../*.yaml
//
// Schema validators that fetch JSON schemas at run time (kubeconform's
// default) need a network this project's machines do not have; the
// scheme ships inside the client-go module.
package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: check FILE.yaml...")
		os.Exit(2)
	}
	types := runtime.NewScheme()
	if err := scheme.AddToScheme(types); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if err := snapshotv1.AddToScheme(types); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	decoder := serializer.NewCodecFactory(types, serializer.EnableStrict).UniversalDeserializer()
	docs, invalid := 0, 0
	for _, path := range os.Args[1:] {
		data, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
		for {
			doc, err := reader.Read()
			if err == io.EOF {
				break
			}
			if err != nil {
				fmt.Printf("%s: INVALID: %v\n", path, err)
				invalid++
				break
			}
			if len(bytes.TrimSpace(doc)) == 0 {
				continue
			}
			docs++
			_, gvk, err := decoder.Decode(doc, nil, nil)
			if err != nil {
				fmt.Printf("%s: INVALID: %v\n", path, err)
				invalid++
				continue
			}
			fmt.Printf("%s: %s %s: valid\n", path, gvk.GroupVersion(), gvk.Kind)
		}
	}
	fmt.Printf("%d documents, %d invalid\n", docs, invalid)
	if invalid > 0 || docs == 0 {
		os.Exit(1)
	}
}
