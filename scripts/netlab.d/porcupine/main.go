// Command porcupine checks the network scenarios' recorded block histories
// (scripts/netlab.d/history.py's logs) for linearizability with Porcupine
// (github.com/anishathalye/porcupine), one 4 KiB block = one register:
//
//	porcupine [-fenced TAG@T]... LOG... READS...
//
// Every file holds history.py's lines: A/K/E (a write sent, acknowledged,
// failed), R BLOCK GOT T1 T2 (a read: the writers' read-backs, and the
// final read of every block that `history.py check --reads-out` writes).
// A write is an operation from its A to its K; one that failed or never
// answered may or may not have taken effect, so it has no return (it may
// be linearized at any point after its call). A read must return the
// register's value; the initial value is "zero". -fenced TAG@T: writes of
// TAG sent at or after T were sent to an engine that had been failed over,
// so they must never take effect: they are left out of the history, and a
// read that finds one is not linearizable.
//
// Prints one line per block that is not linearizable (or whose check ran
// out of time), then "porcupine: N blocks, N operations: N illegal, N
// unknown"; exit status 1 when any block is illegal or unknown.
package main

import (
	"bufio"
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// Per-block check time limit: a block's history is a few hundred
// operations of one writer at a time, checked in milliseconds; a limit
// keeps a pathological history from hanging the run.
const blockTimeout = 10 * time.Second

type input struct {
	write   bool
	version string
}

type fence struct {
	tag   string
	after int64
}

type fences []fence

func (f *fences) String() string { return fmt.Sprint(*f) }
func (f *fences) Set(s string) error {
	tag, at, ok := strings.Cut(s, "@")
	if !ok {
		return fmt.Errorf("want TAG@T, got %q", s)
	}
	t, err := strconv.ParseFloat(at, 64)
	if err != nil {
		return err
	}
	*f = append(*f, fence{tag, int64(t * 1e9)})
	return nil
}

func ns(s string) int64 {
	t, err := strconv.ParseFloat(s, 64)
	if err != nil {
		fmt.Fprintf(os.Stderr, "porcupine: bad time %q\n", s)
		os.Exit(2)
	}
	return int64(t * 1e9)
}

func tagOf(version string) string {
	if i := strings.LastIndexByte(version, '.'); i >= 0 {
		return version[:i]
	}
	return version
}

func main() {
	var fenced fences
	flag.Var(&fenced, "fenced", "TAG@T: writes of TAG sent at or after T must not take effect")
	flag.Parse()
	type write struct {
		block   int
		call    int64
		ret     int64
		version string
	}
	writes := map[string]*write{}
	ops := map[int][]porcupine.Operation{}
	for _, path := range flag.Args() {
		f, err := os.Open(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "porcupine:", err)
			os.Exit(2)
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			x := strings.Fields(sc.Text())
			if len(x) < 4 {
				continue
			}
			switch x[0] {
			case "A":
				b, _ := strconv.Atoi(x[1])
				writes[x[2]] = &write{b, ns(x[3]), math.MaxInt64, x[2]}
			case "K":
				if w := writes[x[2]]; w != nil {
					w.ret = ns(x[3])
				}
			case "R":
				if len(x) < 5 {
					continue
				}
				b, _ := strconv.Atoi(x[1])
				ops[b] = append(ops[b], porcupine.Operation{
					ClientId: 1, Input: input{false, ""}, Call: ns(x[3]), Output: x[2], Return: ns(x[4]),
				})
			}
		}
		f.Close()
	}
	left := 0
	for _, w := range writes {
		skip := false
		for _, fc := range fenced {
			if tagOf(w.version) == fc.tag && w.call >= fc.after {
				skip = true
			}
		}
		if skip {
			left++
			continue
		}
		ops[w.block] = append(ops[w.block], porcupine.Operation{
			ClientId: 0, Input: input{true, w.version}, Call: w.call, Output: "", Return: w.ret,
		})
	}
	model := porcupine.Model{
		Init: func() interface{} { return "zero" },
		Step: func(state, in, out interface{}) (bool, interface{}) {
			i := in.(input)
			if i.write {
				return true, i.version
			}
			return out.(string) == state.(string), state
		},
	}
	blocks := make([]int, 0, len(ops))
	total := 0
	for b, o := range ops {
		blocks = append(blocks, b)
		total += len(o)
	}
	sort.Ints(blocks)
	illegal, unknown := 0, 0
	for _, b := range blocks {
		switch porcupine.CheckOperationsTimeout(model, ops[b], blockTimeout) {
		case porcupine.Illegal:
			illegal++
			fmt.Printf("block %d: not linearizable (%d operations)\n", b, len(ops[b]))
		case porcupine.Unknown:
			unknown++
			fmt.Printf("block %d: no verdict within %s (%d operations)\n", b, blockTimeout, len(ops[b]))
		}
	}
	fmt.Printf("porcupine: %d blocks, %d operations (%d fenced writes left out): %d illegal, %d unknown\n",
		len(blocks), total, left, illegal, unknown)
	if illegal > 0 || unknown > 0 {
		os.Exit(1)
	}
}
